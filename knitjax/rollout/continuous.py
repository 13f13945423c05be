"""Continuous batching: a fixed number of sample slots; a finished sequence's slot takes the next.

Every slot holds one sample (one response of a group) with its own KV cache row, RoPE position
and token budget; the cache is per row (the model's one-index `KVCache` vmapped over slots), so
sequences at different positions decode together and finish out of order, as in production
engines. A new prompt is prefilled in chunks by a prefill lane, interleaved with the decode
iterations of the live slots, and once for all the samples that share it (a group's ``G``
samples): the jitted loop is `knitjax.rollout.continuous_step`. This module keeps the host side:
which sample holds which slot (the device tags slots with the engine's sample ids), which lane
prefills which prompt on which shard, the prompts waiting in the device-side queue
(``queue_prompts``: started inside a call as slots free up, without a return to the host), the
policy versions, and the finished samples (read back from the call's outbox).

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
from knitjax.rollout.engine_requests import Finished, Request, group_requests
from knitjax.rollout.engine_state import Queue, Starts, ended_rows, init_state, make_queue
from knitjax.rollout.placement import Placement, assign, fit, place
from knitjax.rollout.sampler import SamplingConfig, eos_tuple

ADOPTION = ("new_groups", "mid_generation")
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
    prefill_lanes: int = 1,
    prefill_chunk: int = 0,
    share_prefix: bool = True,
    decode_steps: int = 8,
    adoption: str = "mid_generation",
    param_slots: int = 2,
    split_versions: bool = True,
    queue_prompts: int = 0,
    fuse_prefill: bool = False,
    calls_in_flight: int = 1,
  ):
    """Builds an idle engine; call `load` before the first `step`.

    Args:
      graphdef: the policy's graph definition.
      mesh: the rollout mesh; slots and lanes are split over its batch axes.
      sampling: temperature / top-k / top-p and ``max_new_tokens`` (the widest budget).
      slots: concurrent samples (a multiple of the mesh's batch shards).
      prompt_len: prompt width (prompts are left-padded to it, rounded up to whole chunks).
      eos_id: end token, or several (a sample ends at the first of any); pad_id: padding.
      prefill_lanes: prompts each shard prefills at once (a group split over ``k`` shards takes
        one lane on each).
      prefill_chunk: prompt tokens a lane prefills per iteration (0: the whole prompt at once).
      share_prefix: requests with identical prompts started in one call share one prefill (a
        group's ``G`` samples); False prefills each request on its own lane.
      decode_steps: iterations per call at most (bounds how late a new version or a new group is
        taken up).
      adoption: ``"mid_generation"`` (partial rollout) or ``"new_groups"``.
      param_slots: versions held at once with ``"new_groups"`` (1 with mid-generation).
      split_versions: decode each version's live rows in their own bucket (default); False runs
        one pass over every slot per version with live rows (the engine benchmark's baseline).
      queue_prompts: prompts each shard may hold in the device-side queue: requests beyond the
        free room wait there and start inside the call as slots and lanes free up, without a
        return to the host (0: off; every start waits for the host's next call).
      fuse_prefill: run an iteration's prefill chunks inside its decode pass, one forward over the
        live slots' tokens and the lanes' chunks, so live samples never wait for a group's prefill
        (with one param slot, i.e. mid-generation adoption; else the passes stay apart).
      calls_in_flight: engine calls that may be launched and not yet collected (1 or 2). With 2
        the host launches the next call before it collects the running one, so the device never
        waits for the host between calls: the next call decodes on from the running call's
        state. Every prompt then starts from the device queue (the device picks the slots and
        the lane as they free up, which the host learns only at collect): the next call's queue
        holds the waiting prompts the running call's queue does not, and a prompt the running
        call did not start goes to the call after. Needs ``queue_prompts >= 1`` and
        mid-generation adoption.
    """
    shards = math.prod(mesh.shape[a] for a in sharding.BATCH_AXES)
    if adoption not in ADOPTION:
      raise ValueError(f"adoption={adoption!r} is not accepted; choose one of {ADOPTION}.")
    if slots < 1 or slots % shards:
      raise ValueError(f"slots={slots} must be a positive multiple of the {shards} batch shards.")
    if prefill_lanes < 1:
      raise ValueError(f"prefill_lanes={prefill_lanes} must be >= 1.")
    if prefill_chunk < 0:
      raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 0 (0: the whole prompt).")
    if decode_steps < 1:
      raise ValueError(f"decode_steps={decode_steps} must be >= 1.")
    if queue_prompts < 0:
      raise ValueError(f"queue_prompts={queue_prompts} must be >= 0 (0: no device-side queue).")
    if calls_in_flight not in (1, 2):
      raise ValueError(f"calls_in_flight={calls_in_flight} is not accepted; choose 1 or 2.")
    if calls_in_flight == 2 and (queue_prompts < 1 or adoption != "mid_generation"):
      raise ValueError(
        f"calls_in_flight=2 needs queue_prompts >= 1 and adoption='mid_generation' (got "
        f"queue_prompts={queue_prompts}, adoption={adoption!r}): the next call is launched before "
        "the host knows which slots the running one freed, so its prompts start from the device "
        "queue."
      )
    if adoption == "new_groups" and param_slots < 2:
      raise ValueError(f"param_slots={param_slots} must be >= 2 with adoption='new_groups'.")
    self.graphdef, self.mesh, self.sampling = graphdef, mesh, sampling
    self.slots, self.prompt_len = slots, prompt_len
    self.chunk = min(prefill_chunk or prompt_len, prompt_len)
    self.width = -(-prompt_len // self.chunk) * self.chunk  # prompt width in whole chunks
    self.lanes_per_shard, self.share_prefix = prefill_lanes, share_prefix
    self.decode_steps, self.adoption = decode_steps, adoption
    self.eos_ids, self.pad_id = eos_tuple(eos_id), pad_id
    self.eos_id = self.eos_ids[0]
    self.shards = shards
    self._per_shard = slots // shards
    n_params = 1 if adoption == "mid_generation" else param_slots
    self._params: list[tuple[int, object] | None] = [None] * n_params
    self._newest = 0  # param slot new samples start with
    self._pending: tuple[int, object] | None = None  # a version waiting for a free param slot
    self.queue_prompts = queue_prompts
    # Every sample the engine was given and has not returned, by the engine's own id (the tag the
    # device sees): [request, gen version, newest version, param slot] (versions and param slot
    # set when the call that may start it is launched).
    self._samples: dict[int, list] = {}
    self._next_tag = 0
    self._slot_tag = np.full(slots, -1, np.int32)  # the sample each slot holds (-1: free)
    # Prompts not started yet, oldest first, each a list of sample ids sharing one prompt.
    self._waiting: list[list[int]] = []
    self._lane_busy = [False] * (shards * prefill_lanes)
    self._state = None
    self._lanes = None
    # The calls in flight, oldest first: (stats, outbox, slots and lanes after it, version,
    # perf_counter and time.time at launch, samples held before it, prompts the host started,
    # prompts queued on each shard).
    self.calls_in_flight = calls_in_flight
    self._launched: collections.deque[tuple] = collections.deque()
    # Per collected call: (launch, collect begin, collect end) as time.time(), whether the call
    # was still running when collect began (1.0: the device was busy until collect end), loop
    # iterations, decode passes, prefill chunk passes, samples held before the launch, prompts
    # it started, decode passes that carried prefill chunks (``fuse_prefill``);
    # `knitjax.sim.calibration.engine_timeline_fit` measures the stall from it.
    self.timeline: collections.deque[tuple[float, ...]] = collections.deque(maxlen=TIMELINE_ROWS)
    self._call = make_engine_call(
      graphdef=graphdef,
      mesh=mesh,
      sampling=sampling,
      eos_ids=self.eos_ids,
      pad_id=pad_id,
      chunk=self.chunk,
      split_versions=split_versions,
      fuse=fuse_prefill,
    )
    self.fuse_prefill = fuse_prefill and n_params == 1
    self.calls = 0
    self.decode_iterations = 0  # loop iterations (max over shards per call), summed over calls
    self.decode_passes = 0  # iterations that decoded live slots (max over shards)
    self.chunk_passes = 0  # iterations that ran a prefill chunk apart (max over shards)
    self.fused_passes = 0  # decode passes that carried prefill chunks (``fuse_prefill``)
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
    busy = {self._samples[t][3] for t in self._slot_tag if t >= 0}
    free = [i for i in range(len(self._params)) if i not in busy]
    if free:
      self._params[free[0]], self._pending = self._pending, None
      self._newest = free[0]

  # ---- slots and lanes ----------------------------------------------------------------------

  @property
  def free_slots(self) -> int:
    return int(np.sum(self._slot_tag < 0))

  @property
  def live_samples(self) -> int:
    """Samples started and not yet finished (prefilling or decoding)."""
    return self.slots - self.free_slots

  @property
  def queued_samples(self) -> int:
    """Samples given to the engine whose prompt has not started yet (device-side queue)."""
    return sum(len(g) for g in self._waiting)

  def _free(self) -> tuple[list[list[int]], list[list[int]]]:
    per, lanes = self._per_shard, self.lanes_per_shard
    slots = [
      [s for s in range(k * per, (k + 1) * per) if self._slot_tag[s] < 0]
      for k in range(self.shards)
    ]
    free_lanes = [
      [j for j in range(lanes) if not self._lane_busy[k * lanes + j]] for k in range(self.shards)
    ]
    return slots, free_lanes

  def _fit(self, sizes: Sequence[int]) -> tuple[int, list, list[list[int]], list[list[int]]]:
    """How many of the prompts of ``sizes`` (oldest first) start now, their placement, and the
    free slots and lanes left after them (with two calls in flight none: all go to the queue)."""
    if self.calls_in_flight > 1:
      return 0, [], *self._free()
    shares, slots, lanes = fit(*self._free(), sizes)
    return len(shares), shares, slots, lanes

  def _queueable(self, size: int) -> bool:
    return self.queue_prompts > 0 and size <= self._per_shard

  def _queue_room(self, left: Sequence[int]) -> int:
    """Prompts the device queue can still take once prompts of ``left`` sizes wait in it
    (negative: they do not all fit)."""
    if not all(map(self._queueable, left)):
      return -1
    # With two calls in flight the prompts wait in the running call's queue or the next one's.
    return self.calls_in_flight * self.shards * self.queue_prompts - len(left)

  def capacity(self, group_size: int, queued: Sequence[int] = ()) -> int:
    """How many more prompts of ``group_size`` samples fit now (started at once or queued on the
    device), after the engine's waiting prompts and prompts of ``queued`` sizes (each a prompt
    shared by that many samples)."""
    per_prompt = [group_size] if self.share_prefix else [1] * group_size
    sizes = [len(g) for g in self._waiting]
    sizes += list(queued) if self.share_prefix else [1] * sum(queued)
    n_fit, _, slots, lanes = self._fit(sizes)
    left = sizes[n_fit:]
    room = self._queue_room(left)
    if room < 0:
      return 0
    n = 0
    while self.calls_in_flight == 1 and not left and place(slots, lanes, per_prompt) is not None:
      n += 1
    if all(self._queueable(z) for z in per_prompt):
      n += room // len(per_prompt)
    return n

  def _take(self, requests: Sequence[Request]) -> tuple[list[Placement], list[list[int]]]:
    """Adds ``requests`` to the waiting prompts; returns where the prompts that fit now start and,
    per shard, the waiting prompts queued on the device (all or nothing: ValueError)."""
    groups = group_requests(
      requests,
      prompt_len=self.prompt_len,
      max_new_tokens=self.sampling.max_new_tokens,
      share_prefix=self.share_prefix,
    )
    sizes = [len(g) for g in self._waiting] + [len(g) for g in groups]
    n_fit, shares, _, _ = self._fit(sizes)
    left = sizes[n_fit:]
    if self._queue_room(left) < 0:
      raise ValueError(
        f"{len(requests)} requests ({len(groups)} prompts) do not fit: free slots="
        f"{self.free_slots}, free prefill lanes={self._lane_busy.count(False)}, {len(left)} "
        f"prompts would wait but the device queue holds "
        f"{self.calls_in_flight * self.shards * self.queue_prompts}"
        f" (prompts of at most {self._per_shard} samples)."
      )
    for g in groups:
      tags = list(range(self._next_tag, self._next_tag + len(g)))
      self._next_tag += len(g)
      for t, req in zip(tags, g, strict=True):
        self._samples[t] = [req, None, None, None]
      self._waiting.append(tags)
    plan = []
    slots, _ = self._free()
    for tags, group_shares in zip(self._waiting[:n_fit], shares, strict=True):
      for shard, lane, n in group_shares:
        taken, slots[shard] = slots[shard][:n], slots[shard][n:]
        tagged = [(t, self._samples[t][0]) for t in tags[:n]]
        plan.append(Placement(shard * self.lanes_per_shard + lane, taken, tagged))
        tags = tags[n:]
    del self._waiting[:n_fit]
    if self.calls_in_flight == 1:
      return plan, assign(len(self._waiting), [len(s) for s in slots])
    # The waiting prompts no call in flight holds in its queue, as many as one queue takes.
    held = {id(g) for *_, queued in self._launched for gs in queued for g in gs}
    free = [i for i, g in enumerate(self._waiting) if id(g) not in held]
    free = free[: self.shards * self.queue_prompts]
    return plan, [[free[j] for j in idx] for idx in assign(len(free), [0] * self.shards)]

  def _starts(self, plan: list[Placement]) -> Starts:
    n_lanes = self.shards * self.lanes_per_shard
    prompt = np.full((n_lanes, self.width), self.pad_id, np.int32)
    plen = np.ones(n_lanes, np.int32)
    new = np.zeros(n_lanes, bool)
    wait = np.full(self.slots, -1, np.int32)
    budget = np.ones(self.slots, np.int32)
    tag = np.full(self.slots, -1, np.int32)
    for lane, slots, tagged in plan:
      toks = np.asarray(tagged[0][1].tokens, np.int32)
      prompt[lane, self.width - len(toks) :] = toks
      plen[lane], new[lane] = len(toks), True
      self._lane_busy[lane] = True
      for s, (t, req) in zip(slots, tagged, strict=True):
        wait[s], budget[s], tag[s] = lane % self.lanes_per_shard, req.max_new_tokens, t
        self._slot_tag[s] = t
    self.prefills += len(plan)
    return Starts(
      prompt=prompt,
      plen=plen,
      new=new,
      pslot=np.int32(self._newest),
      wait=wait,
      budget=budget,
      tag=tag,
    )

  def _queue(self, per_shard: list[list[int]]) -> Queue:
    entries = []
    for idx in per_shard:
      reqs = [(self._samples[self._waiting[i][0]][0], self._waiting[i]) for i in idx]
      entries.append([(r.tokens, len(tags), r.max_new_tokens, tags[0]) for r, tags in reqs])
    return make_queue(entries, depth=self.queue_prompts, width=self.width, pad_id=self.pad_id)

  def _init_state(self, params):
    model = nnx.merge(self.graphdef, params)
    return init_state(
      model,
      slots=self.slots,
      lanes=self.shards * self.lanes_per_shard,
      width=self.width,
      max_new_tokens=self.sampling.max_new_tokens,
      pad_id=self.pad_id,
    )

  def step(self, requests: Sequence[Request], *, rng: jax.Array, stop_free: int) -> list[Finished]:
    """Starts ``requests`` (their prompts in free lanes, their samples in free slots), then runs
    prefill chunks and decode iterations; returns the samples that finished (`launch` then
    `collect`). With ``calls_in_flight=2`` the call just launched keeps running: a step returns
    the samples of the call before it (none at the first), and `collect` those of the last.

    Args:
      requests: new samples; they must fit (`capacity`), else ValueError and nothing starts.
      rng: key of this call.
      stop_free: stop once this many slots are free (0: run ``decode_steps`` iterations or until
        nothing is live or prefilling).
    """
    self.launch(requests, rng=rng, stop_free=stop_free)
    if self.calls_in_flight > 1 and self.launched < 2:
      return []  # the call runs on; the next step (or `collect`) returns its samples
    return self.collect()

  @property
  def in_flight(self) -> bool:
    """A launched call has not been collected yet."""
    return bool(self._launched)

  @property
  def launched(self) -> int:
    """Calls launched and not yet collected."""
    return len(self._launched)

  @property
  def can_launch(self) -> bool:
    """Fewer than ``calls_in_flight`` calls are launched and not collected."""
    return len(self._launched) < self.calls_in_flight

  def launch(self, requests: Sequence[Request], *, rng: jax.Array, stop_free: int) -> None:
    """`step` without waiting: places ``requests`` and dispatches the call; the device runs it
    while the host goes on (JAX dispatches asynchronously). `collect` returns its finished
    samples. Slots and lanes the call may free count as busy until then (`capacity` is
    conservative meanwhile); `load` may run in between (the call keeps the params it got). With
    ``calls_in_flight=2`` a second call may be launched before the first is collected; it runs
    after it on the device."""
    if not self.can_launch:
      raise RuntimeError(
        f"{len(self._launched)} launched call(s) were not collected (calls_in_flight="
        f"{self.calls_in_flight}); call collect() first."
      )
    self._adopt_pending()
    if self.version is None:
      raise RuntimeError("the engine has no weights; call load(params, version) first.")
    held = self.live_samples
    plan, per_shard = self._take(requests)
    version = self.version
    starting = [t for p in plan for t, _ in p.requests]
    starting += [t for idx in per_shard for i in idx for t in self._waiting[i]]
    for t in starting:  # queued prompts that start later in the call decode with it too
      self._samples[t][1:] = [version, version, self._newest]
    starts, queue = self._starts(plan), self._queue(per_shard)
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
        queue,
        rng,
        np.int32(stop_free),
        np.int32(self.decode_steps),
      )
    queued = [[self._waiting[i] for i in idx] for idx in per_shard]
    started = int(np.sum(starts.new))
    self._launched.append((stats, out, after, version, t0, t_launch, held, started, queued))

  def collect(self) -> list[Finished]:
    """Waits for the oldest launched call (none: returns []) and returns the samples it
    finished."""
    if not self._launched:
      return []
    stats, out, after, version, t0, t_launch, held, started, queued = self._launched.popleft()
    t_begin, running = time.time(), not stats.iterations.is_ready()
    with jax.set_mesh(self.mesh):
      tag, active, stats, n_out = sharding.to_host((*after, stats, out.count))
    # The slots and lanes after this call (a call still in flight starts prompts only from its
    # queue: the host learns of them when it collects that call).
    self._slot_tag = np.asarray(tag, np.int32).copy()
    self.call_s += time.perf_counter() - t0
    self.calls += 1
    self.decode_iterations += int(np.max(stats.iterations))
    self.decode_passes += int(np.max(stats.decode_passes))
    self.chunk_passes += int(np.max(stats.chunk_passes))
    self.fused_passes += int(np.max(stats.fused_passes))
    self.rows_decoded += int(np.sum(stats.rows))
    self.rows_unsplit += int(np.sum(stats.rows_unsplit))
    self._lane_busy = [bool(a) for a in active]
    taken = [g[: int(k)] for g, k in zip(queued, stats.taken, strict=True)]
    started_now = {id(g) for gs in taken for g in gs}
    self._waiting = [g for g in self._waiting if id(g) not in started_now]
    self.prefills += sum(map(len, taken))
    started += sum(map(len, taken))
    counts = (np.max(stats.iterations), np.max(stats.decode_passes), np.max(stats.chunk_passes))
    fused = float(np.max(stats.fused_passes))
    row = (t_launch, t_begin, time.time(), float(running), *map(float, counts), held, started)
    row += (fused,)
    self.timeline.append(row)
    rows = [k * (len(out.tag) // self.shards) + i for k, n in enumerate(n_out) for i in range(n)]
    return self._harvest(out, rows, tag, version)

  def _harvest(self, out, rows: list[int], tag: np.ndarray, version: int) -> list[Finished]:
    """The samples of outbox ``rows``, after a call that decoded with ``version`` (mid-generation
    adoption: the newest version every sample it decoded has used now); ``tag``: the slots'
    samples after it."""
    gather = self.calls_in_flight == 1
    tokens, logprobs, length, ids = ended_rows(out, rows, gather=gather) if rows else ([],) * 4
    if self.adoption == "mid_generation":
      for t in [*tag[tag >= 0], *ids]:
        self._samples[int(t)][2] = version
    finished = []
    for i, t in enumerate(ids):
      req, first, newest, _ = self._samples.pop(int(t))
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
