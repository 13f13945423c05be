"""Continuous batching: a fixed number of sample slots; a finished sequence's slot takes the next.

Every slot holds one sample (one response of a group) with its own KV cache row, RoPE position
and token budget; the cache is per row (the model's one-index `KVCache` vmapped over slots), so
sequences at different positions decode together and finish out of order, as in production
engines. A new prompt is prefilled in chunks by a prefill lane, interleaved with the decode
iterations of the live slots, and once for all the samples that share it (a group's ``G``
samples): the jitted loop is `knitjax.rollout.continuous_step`. This module keeps the host side:
the policy versions, the calls (launched, then collected) and the finished samples (read back
from a call's outbox).
Which sample holds which slot and which lane prefills which prompt are the engine's
`knitjax.rollout.slot_book.SlotBook`.

Weights: `load` installs a new policy version. With ``adoption="mid_generation"`` (partial
rollout) live samples switch to it at once; the sample's gen version stays the oldest version it
used and the newest is recorded too. With ``adoption="new_groups"`` the engine holds up to
``param_slots`` versions and decodes each sample with the version it started with (one decode
pass per live version); a new version waits while every param slot still has live samples.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from knitjax import sharding
from knitjax.rollout.continuous_step import make_engine_call
from knitjax.rollout.contract import ADOPTION
from knitjax.rollout.engine_requests import Finished, Request
from knitjax.rollout.engine_state import ended_rows, init_state
from knitjax.rollout.sampler import SamplingConfig, eos_tuple
from knitjax.rollout.slot_book import SlotBook

TIMELINE_ROWS = 200_000  # calls the timeline keeps (the newest): bounded memory in long runs


class ContinuousEngine:
  """Host side of the engine: slot and lane bookkeeping, weight versions and the jitted calls.

  Not thread-safe: one thread (the rollout worker) drives it.
  """

  def __init__(
    self,
    graphdef: nnx.GraphDef,
    *,
    mesh: jax.sharding.Mesh,
    sampling: SamplingConfig,
    slots: int,
    prompt_len: int,
    eos_id: int | Sequence[int],
    pad_id: int,
    refill_groups: int,
    prefill_chunk: int,
    decode_steps: int,
    adoption: str,
    param_slots: int,
    share_prefix: bool = True,
    split_versions: bool = True,
  ):
    """Builds an idle engine; call `load` before the first `step`.

    Args:
      graphdef: the policy's graph definition.
      mesh: the rollout mesh; slots and lanes are split over its batch axes.
      sampling: temperature / top-k / top-p and ``max_new_tokens`` (the widest budget).
      slots: concurrent samples (a multiple of the mesh's batch shards).
      prompt_len: prompt width (prompts are left-padded to it, rounded up to whole chunks).
      eos_id: end token, or several (a sample ends at the first of any); pad_id: padding.
      refill_groups: prompts each shard prefills at once, each in its own prefill lane (a group
        split over ``k`` shards takes one lane on each).
      prefill_chunk: prompt tokens a lane prefills per iteration (0: the whole prompt at once).
      decode_steps: iterations per call at most (bounds how late a new version or a new group is
        taken up).
      adoption: ``"mid_generation"`` (partial rollout) or ``"new_groups"``.
      param_slots: versions held at once with ``"new_groups"`` (1 with mid-generation).
      share_prefix: requests with identical prompts started in one call share one prefill (a
        group's ``G`` samples); False (the engine benchmark's baseline) prefills each request on
        its own lane.
      split_versions: decode each version's live rows in their own bucket; False (the engine
        benchmark's baseline) runs one pass over every slot per version with live rows.

    The settings without defaults are the config's (`knitjax.config_sections.RolloutConfig`,
    `sync.adoption`, `sync.held_versions`): the run's builder passes them, so the config
    holds the one set of defaults.
    """
    shards = math.prod(mesh.shape[a] for a in sharding.BATCH_AXES)
    if adoption not in ADOPTION:
      raise ValueError(f"adoption={adoption!r} is not accepted; choose one of {ADOPTION}.")
    if slots < 1 or slots % shards:
      raise ValueError(f"slots={slots} must be a positive multiple of the {shards} batch shards.")
    if refill_groups < 1:
      raise ValueError(f"refill_groups={refill_groups} must be >= 1.")
    if prefill_chunk < 0:
      raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 0 (0: the whole prompt).")
    if decode_steps < 1:
      raise ValueError(f"decode_steps={decode_steps} must be >= 1.")
    if adoption == "new_groups" and param_slots < 2:
      raise ValueError(f"param_slots={param_slots} must be >= 2 with adoption='new_groups'.")
    self.graphdef, self.mesh, self.sampling = graphdef, mesh, sampling
    self.slots = slots
    self.chunk = min(prefill_chunk or prompt_len, prompt_len)
    self.width = -(-prompt_len // self.chunk) * self.chunk  # prompt width in whole chunks
    self.refill_groups = refill_groups
    self.decode_steps, self.adoption = decode_steps, adoption
    self.eos_ids, self.pad_id = eos_tuple(eos_id), pad_id
    self.eos_id = self.eos_ids[0]
    self.shards = shards
    n_params = 1 if adoption == "mid_generation" else param_slots
    self._params: list[tuple[int, object] | None] = [None] * n_params
    self._newest = 0  # param slot new samples start with
    self._pending: tuple[int, object] | None = None  # a version waiting for a free param slot
    self.book = SlotBook(
      slots=slots,
      shards=shards,
      refill_groups=refill_groups,
      prompt_len=prompt_len,
      width=self.width,
      pad_id=pad_id,
      max_new_tokens=sampling.max_new_tokens,
      share_prefix=share_prefix,
    )
    self._state = None
    self._lanes = None
    # The call launched and not yet collected: (stats, outbox, slots and lanes after it, version,
    # perf_counter and time.time at launch, samples held before it, prompts it started).
    self._launched: tuple | None = None
    # Per collected call: (launch, collect begin, collect end) as time.time(), whether the call
    # was still running when collect began (1.0: the device was busy until collect end), loop
    # iterations, decode passes, prefill chunk passes, samples held before the launch, prompts
    # it started; `knitjax.sim.calibration.engine_timeline_fit` measures the stall from it.
    self.timeline: collections.deque[tuple[float, ...]] = collections.deque(maxlen=TIMELINE_ROWS)
    self._call = make_engine_call(
      graphdef=graphdef,
      mesh=mesh,
      sampling=sampling,
      eos_ids=self.eos_ids,
      pad_id=pad_id,
      chunk=self.chunk,
      split_versions=split_versions,
    )
    self.calls = 0
    self.decode_iterations = 0  # loop iterations (max over shards per call), summed over calls
    self.decode_passes = 0  # iterations that decoded live slots (max over shards)
    self.chunk_passes = 0  # iterations that ran a prefill chunk pass (max over shards)
    self.prefills = 0  # prompts prefilled (lanes started)
    self.rows_decoded = 0  # slot rows the decode passes computed, summed over shards and passes
    self.rows_unsplit = 0  # the same with one pass over every slot per live version (old rule)
    self.call_s = 0.0

  # ---- weights ------------------------------------------------------------------------------

  @property
  def version(self) -> int | None:
    """Version new samples start with (None before the first `load`)."""
    held = self._params[self._newest]
    return None if held is None else held[0]

  def load(self, params, version: int) -> None:
    """Installs policy ``version`` (params already on the rollout mesh) per the adoption rule."""
    self._pending = (version, params)
    self._adopt_pending()

  def _adopt_pending(self) -> None:
    if self._pending is None:
      return
    if len(self._params) == 1:
      self._params[0], self._pending = self._pending, None
      return
    busy = self.book.param_slots_in_use()
    free = [i for i in range(len(self._params)) if i not in busy]
    if free:
      self._params[free[0]], self._pending = self._pending, None
      self._newest = free[0]

  # ---- slots and lanes (`SlotBook`) ----------------------------------------------------------

  @property
  def free_slots(self) -> int:
    return self.book.free_slots

  @property
  def live_samples(self) -> int:
    """Samples started and not yet finished (prefilling or decoding)."""
    return self.book.live_samples

  def capacity(self, group_size: int, queued: Sequence[int] = ()) -> int:
    """How many more prompts of ``group_size`` samples start now, after prompts of ``queued``
    sizes (each a prompt shared by that many samples)."""
    return self.book.capacity(group_size, queued)

  def _init_state(self, params):
    model = nnx.merge(self.graphdef, params)
    return init_state(
      model,
      slots=self.slots,
      lanes=self.shards * self.refill_groups,
      width=self.width,
      max_new_tokens=self.sampling.max_new_tokens,
      pad_id=self.pad_id,
    )

  def step(self, requests: Sequence[Request], *, rng: jax.Array, stop_free: int) -> list[Finished]:
    """Starts ``requests`` (their prompts in free lanes, their samples in free slots), then runs
    prefill chunks and decode iterations; returns the samples that finished (`launch` then
    `collect`).

    Args:
      requests: new samples; they must fit (`capacity`), else ValueError and nothing starts.
      rng: key of this call.
      stop_free: stop once this many slots are free (0: run ``decode_steps`` iterations or until
        nothing is live or prefilling).
    """
    self.launch(requests, rng=rng, stop_free=stop_free)
    return self.collect()

  @property
  def in_flight(self) -> bool:
    """A launched call has not been collected yet."""
    return self._launched is not None

  def launch(self, requests: Sequence[Request], *, rng: jax.Array, stop_free: int) -> None:
    """`step` without waiting: places ``requests`` and dispatches the call; the device runs it
    while the host goes on (JAX dispatches asynchronously). `collect` returns its finished
    samples. Slots and lanes the call may free count as busy until then (`capacity` is
    conservative meanwhile); `load` may run in between (the call keeps the params it got)."""
    if self._launched is not None:
      raise RuntimeError("the launched call was not collected; call collect() first.")
    self._adopt_pending()
    if self.version is None:
      raise RuntimeError("the engine has no weights; call load(params, version) first.")
    held = self.live_samples
    book = self.book
    plan = book.take(requests)
    version = self.version
    for t in [t for p in plan for t, _ in p.requests]:
      book.samples[t][1:] = [version, version, self._newest]
    starts = book.starts(plan, self._newest)
    self.prefills += len(plan)
    if self._state is None:
      spec = NamedSharding(self.mesh, PartitionSpec(sharding.BATCH_AXES))
      init = jax.jit(self._init_state, out_shardings=(spec, spec))
      with jax.set_mesh(self.mesh):
        self._state, self._lanes = init(self._params[self._newest][1])
    params = tuple((p if p is not None else self._params[self._newest])[1] for p in self._params)
    t0, t_launch = time.perf_counter(), time.time()
    with jax.set_mesh(self.mesh):
      self._state, self._lanes, out, stats, after = self._call(
        params,
        self._state,
        self._lanes,
        starts,
        rng,
        np.int32(stop_free),
        np.int32(self.decode_steps),
      )
    started = int(np.sum(starts.new))
    self._launched = (stats, out, after, version, t0, t_launch, held, started)

  def collect(self) -> list[Finished]:
    """Waits for the launched call (none: returns []) and returns the samples it finished."""
    if self._launched is None:
      return []
    stats, out, after, version, t0, t_launch, held, started = self._launched
    self._launched = None
    t_begin, running = time.time(), not stats.iterations.is_ready()
    with jax.set_mesh(self.mesh):
      tag, active, stats, n_out = sharding.to_host((*after, stats, out.count))
    self.call_s += time.perf_counter() - t0
    self.calls += 1
    self.decode_iterations += int(np.max(stats.iterations))
    self.decode_passes += int(np.max(stats.decode_passes))
    self.chunk_passes += int(np.max(stats.chunk_passes))
    self.rows_decoded += int(np.sum(stats.rows))
    self.rows_unsplit += int(np.sum(stats.rows_unsplit))
    self.book.collected(tag, active)
    counts = (np.max(stats.iterations), np.max(stats.decode_passes), np.max(stats.chunk_passes))
    row = (t_launch, t_begin, time.time(), float(running), *map(float, counts), held, started)
    self.timeline.append(row)
    rows = [k * (len(out.tag) // self.shards) + i for k, n in enumerate(n_out) for i in range(n)]
    return self._harvest(out, rows, tag, version)

  def _harvest(self, out, rows: list[int], tag: np.ndarray, version: int) -> list[Finished]:
    """The samples of outbox ``rows``, after a call that decoded with ``version`` (mid-generation
    adoption: the newest version every sample it decoded has used now); ``tag``: the slots'
    samples after it."""
    tokens, logprobs, length, ids = ended_rows(out, rows) if rows else ([],) * 4
    if self.adoption == "mid_generation":
      for t in [*tag[tag >= 0], *ids]:
        self.book.samples[int(t)][2] = version
    finished = []
    for i, t in enumerate(ids):
      req, first, newest, _ = self.book.samples.pop(int(t))
      n = int(length[i])
      finished.append(
        Finished(
          tag=req.tag,
          tokens=tokens[i, :n].copy(),
          logprobs=logprobs[i, :n].copy(),
          version=first,
          version_newest=newest,
        )
      )
    return finished
