"""Continuous batching: a fixed number of sample slots; a finished sequence's slot takes the next.

Every slot holds one sample (one response of a group) with its own KV cache row, RoPE position
and token budget; the cache is per row (the model's one-index `KVCache` vmapped over slots), so
sequences at different positions decode together and finish out of order, as in production
engines. Each call prefills new prompts into free slots and decodes, in fixed jitted shapes
(`knitjax.rollout.continuous_step`); this module keeps the host side: which request holds which
slot, the policy versions, and the finished samples.

Weights: `load` installs a new policy version. With ``adoption="mid_generation"`` (partial
rollout) live samples switch to it at once; the sample's gen version stays the oldest version it
used and the newest is recorded too. With ``adoption="new_groups"`` the engine holds up to
``param_slots`` versions and decodes each sample with the version it started with (one decode
pass per live version); a new version waits while every param slot still has live samples.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from knitjax import sharding
from knitjax.rollout.continuous_step import SlotState, engine_call, fresh_cache
from knitjax.rollout.sampler import SamplingConfig, eos_tuple

ADOPTION = ("new_groups", "mid_generation")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
  """One sample to generate: ``tag`` is the caller's (e.g. ``(group_id, k)``)."""

  tag: object
  tokens: np.ndarray  # 1-D prompt ids, BOS first
  max_new_tokens: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Finished:
  """A finished sample: tokens and log-probs up to its length, and the versions it used."""

  tag: object
  tokens: np.ndarray  # [length] int32, EOS last when produced
  logprobs: np.ndarray  # [length] float32
  version: int  # oldest policy version used (gen version)
  version_newest: int  # newest policy version used


class ContinuousEngine:
  """Host side of the engine: slot bookkeeping, weight versions and the jitted calls.

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
    refill_rows: int,
    decode_steps: int = 8,
    adoption: str = "mid_generation",
    param_slots: int = 2,
  ):
    """Builds an idle engine; call `load` before the first `step`.

    Args:
      graphdef: the policy's graph definition.
      mesh: the rollout mesh; slots are split over its batch axes.
      sampling: temperature / top-k / top-p and ``max_new_tokens`` (the widest budget).
      slots: concurrent samples (a multiple of the mesh's batch shards).
      prompt_len: padded prompt length (prompts are left-padded to it).
      eos_id: end token, or several (a sample ends at the first of any); pad_id: padding.
      refill_rows: prompts prefilled per call (fixed shape; e.g. a group's G samples).
      decode_steps: decode iterations per call at most (bounds how late a new version or a new
        group is taken up).
      adoption: ``"mid_generation"`` (partial rollout) or ``"new_groups"``.
      param_slots: versions held at once with ``"new_groups"`` (1 with mid-generation).
    """
    shards = math.prod(mesh.shape[a] for a in sharding.BATCH_AXES)
    if adoption not in ADOPTION:
      raise ValueError(f"adoption={adoption!r} is not accepted; choose one of {ADOPTION}.")
    if slots < 1 or slots % shards:
      raise ValueError(f"slots={slots} must be a positive multiple of the {shards} batch shards.")
    if not 1 <= refill_rows <= slots:
      raise ValueError(f"refill_rows={refill_rows} must be in [1, slots={slots}].")
    if decode_steps < 1:
      raise ValueError(f"decode_steps={decode_steps} must be >= 1.")
    if adoption == "new_groups" and param_slots < 2:
      raise ValueError(f"param_slots={param_slots} must be >= 2 with adoption='new_groups'.")
    self.graphdef, self.mesh, self.sampling = graphdef, mesh, sampling
    self.slots, self.prompt_len, self.refill_rows = slots, prompt_len, refill_rows
    self.decode_steps, self.adoption = decode_steps, adoption
    self.eos_ids, self.pad_id = eos_tuple(eos_id), pad_id
    self.eos_id = self.eos_ids[0]
    self.shards = shards
    n_params = 1 if adoption == "mid_generation" else param_slots
    self._params: list[tuple[int, object] | None] = [None] * n_params
    self._newest = 0  # param slot new samples start with
    self._pending: tuple[int, object] | None = None  # a version waiting for a free param slot
    self._slot_req: list[Request | None] = [None] * slots
    self._slot_versions: list[list[int]] = [[0, 0] for _ in range(slots)]
    self._slot_pslot = [0] * slots
    self._state = None
    self.calls = 0
    self.decode_iterations = 0  # per shard, summed over calls (max over shards per call)
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
    busy = {self._slot_pslot[s] for s, r in enumerate(self._slot_req) if r is not None}
    free = [i for i in range(len(self._params)) if i not in busy]
    if free:
      self._params[free[0]], self._pending = self._pending, None
      self._newest = free[0]

  # ---- slots --------------------------------------------------------------------------------

  @property
  def free_slots(self) -> int:
    return sum(r is None for r in self._slot_req)

  @property
  def live_samples(self) -> int:
    return self.slots - self.free_slots

  def _init_state(self, params):
    model = nnx.merge(self.graphdef, params)
    s, n = self.slots, self.sampling.max_new_tokens
    zeros = lambda dtype: jnp.zeros((s,), dtype)  # noqa: E731
    return SlotState(
      cache=fresh_cache(model, s, self.prompt_len + n),
      last_token=zeros(jnp.int32),
      position=zeros(jnp.int32),
      tokens=jnp.full((s, n), self.pad_id, jnp.int32),
      logprobs=jnp.zeros((s, n), jnp.float32),
      length=zeros(jnp.int32),
      budget=zeros(jnp.int32),
      pslot=zeros(jnp.int32),
      live=zeros(jnp.bool_),
    )

  def _refill_arrays(self, requests: Sequence[Request]) -> tuple:
    r, p = self.refill_rows, self.prompt_len
    slot = np.zeros(r, np.int32)
    prompts = np.full((r, p), self.pad_id, np.int32)
    plens = np.ones(r, np.int32)
    budget = np.ones(r, np.int32)
    valid = np.zeros(r, bool)
    free = [s for s, q in enumerate(self._slot_req) if q is None]
    version = self.version
    for k, req in enumerate(requests):
      n = len(req.tokens)
      if not 1 <= n <= p:
        raise ValueError(f"request {req.tag}: prompt of {n} tokens; accepted: 1..{p}.")
      if not 1 <= req.max_new_tokens <= self.sampling.max_new_tokens:
        raise ValueError(
          f"request {req.tag}: max_new_tokens={req.max_new_tokens}; accepted: 1.."
          f"{self.sampling.max_new_tokens}."
        )
      s = free[k]
      slot[k], plens[k], budget[k], valid[k] = s, n, req.max_new_tokens, True
      prompts[k, p - n :] = req.tokens
      self._slot_req[s] = req
      self._slot_versions[s] = [version, version]
      self._slot_pslot[s] = self._newest
    return slot, prompts, plens, budget, valid, np.int32(self._newest)

  def step(self, requests: Sequence[Request], *, rng: jax.Array, stop_free: int) -> list[Finished]:
    """Starts ``requests`` in free slots, then decodes; returns the samples that finished.

    Args:
      requests: at most ``refill_rows`` and at most `free_slots` new samples.
      rng: key of this call.
      stop_free: stop decoding once this many slots are free (0: run ``decode_steps``
        iterations or until no sample is live).
    """
    if len(requests) > min(self.refill_rows, self.free_slots):
      raise ValueError(
        f"{len(requests)} requests do not fit: refill_rows={self.refill_rows}, "
        f"free slots={self.free_slots}."
      )
    self._adopt_pending()
    if self.version is None:
      raise RuntimeError("the engine has no weights; call load(params, version) first.")
    if self._state is None:
      state_sharding = NamedSharding(self.mesh, PartitionSpec(sharding.BATCH_AXES))
      init = jax.jit(self._init_state, out_shardings=state_sharding)
      with jax.set_mesh(self.mesh):
        self._state = init(self._params[self._newest][1])
    refill = self._refill_arrays(requests)
    params = tuple((p if p is not None else self._params[self._newest])[1] for p in self._params)
    t0 = time.perf_counter()
    with jax.set_mesh(self.mesh):
      self._state, steps = engine_call(
        params,
        self._params[self._newest][1],
        self._state,
        refill,
        rng,
        np.int32(stop_free),
        np.int32(self.decode_steps),
        graphdef=self.graphdef,
        mesh=self.mesh,
        sampling=self.sampling,
        eos_ids=self.eos_ids,
        pad_id=self.pad_id,
      )
      live, steps = sharding.to_host((self._state.live, steps))
    self.call_s += time.perf_counter() - t0
    self.calls += 1
    self.decode_iterations += int(np.max(steps))
    return self._harvest(live)

  def _harvest(self, live: np.ndarray) -> list[Finished]:
    if self.adoption == "mid_generation":
      for s, req in enumerate(self._slot_req):
        if req is not None:
          self._slot_versions[s][1] = self.version
    ended = [s for s, req in enumerate(self._slot_req) if req is not None and not live[s]]
    if not ended:
      return []
    st = self._state
    tokens, logprobs, length = sharding.to_host((st.tokens, st.logprobs, st.length))
    out = []
    for s in ended:
      n = int(length[s])
      first, newest = self._slot_versions[s]
      out.append(
        Finished(
          tag=self._slot_req[s].tag,
          tokens=tokens[s, :n].copy(),
          logprobs=logprobs[s, :n].copy(),
          version=first,
          version_newest=newest,
        )
      )
      self._slot_req[s] = None
    return out
