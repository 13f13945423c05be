"""Device state of the continuous engine: slots, prefill lanes, a call's starts, the outbox and
the call's counters (`knitjax.rollout.continuous_step` runs the
call; `knitjax.rollout.continuous` keeps the host side)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from knitjax import sharding


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
  """Device state of all slots (leading axis: slot)."""

  cache: object  # KVCache with per-slot leaves [S, 1, ...] and index [S]
  last_token: jax.Array  # [S] token to feed next
  position: jax.Array  # [S] RoPE position of `last_token`
  tokens: jax.Array  # [S, N] generated tokens, pad after the end
  logprobs: jax.Array  # [S, N]
  length: jax.Array  # [S] generated tokens so far
  budget: jax.Array  # [S] max new tokens of the slot's sample
  pslot: jax.Array  # [S] param slot the sample decodes with
  live: jax.Array  # [S] bool: holds a sample that has not finished
  wait: jax.Array  # [S] shard-local lane the slot waits on (-1: none)
  tag: jax.Array  # [S] the host's id of the sample the slot holds (-1: the slot is free)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LaneState:
  """Device state of the prefill lanes (leading axis: lane)."""

  cache: object  # KVCache rows [L, 1, ...], index [L]
  prompt: jax.Array  # [L, Pp] left-padded prompt
  plen: jax.Array  # [L] prompt tokens
  chunk: jax.Array  # [L] next chunk to prefill
  pslot: jax.Array  # [L] param slot the prompt is prefilled with
  active: jax.Array  # [L] bool: a prompt is being prefilled


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Starts:
  """What the host starts in one call: new lane prompts and the slots that wait on them."""

  prompt: jax.Array  # [L] rows of [Pp]: prompts of lanes started now
  plen: jax.Array  # [L]
  new: jax.Array  # [L] bool: the lane starts a prompt in this call
  pslot: jax.Array  # [] param slot of the lanes started now
  wait: jax.Array  # [S] shard-local lane a slot starts waiting on (-1: none)
  budget: jax.Array  # [S] max new tokens of the slots that start waiting
  tag: jax.Array  # [S] sample ids of the slots that start waiting


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Outbox:
  """Samples finished during the call (leading axis: row, per shard in finishing order); a slot
  is free again the iteration its sample ends."""

  tokens: jax.Array  # [O, N]
  logprobs: jax.Array  # [O, N]
  length: jax.Array  # [O]
  tag: jax.Array  # [O]
  count: jax.Array  # [shards] rows filled on each shard


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CallStats:
  """Per shard: loop iterations, decode passes, prefill chunk passes, slot rows decoded."""

  iterations: jax.Array
  decode_passes: jax.Array
  chunk_passes: jax.Array
  rows: jax.Array  # slot rows the decode passes computed (live or not), summed over passes
  rows_unsplit: jax.Array  # what one pass over every slot per live version would have computed


def fresh_cache(model, rows: int, max_len: int):
  return jax.vmap(lambda _: model.init_cache(1, max_len))(jnp.arange(rows))


@jax.jit
def _take_rows(out, rows):
  return out.tokens[rows], out.logprobs[rows], out.length[rows], out.tag[rows]


def ended_rows(out, rows: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Tokens, log-probs, lengths and sample ids of the outbox ``rows``, as NumPy in that order.

  The rows are gathered on device first, so the host reads only them rather than the whole
  outbox; the row count is padded to a power of two (repeating a row) to bound recompiles.
  """
  size = 1 << (len(rows) - 1).bit_length()
  idx = np.asarray(rows + rows[:1] * (size - len(rows)), np.int32)
  got = sharding.to_host(_take_rows(out, idx))
  return tuple(x[: len(rows)] for x in got)


def init_state(model, *, slots: int, lanes: int, width: int, max_new_tokens: int, pad_id: int):
  """Empty slots and lanes: every cache row fresh, nothing live, waiting or prefilling."""
  s, n, w = slots, max_new_tokens, width
  zeros = lambda rows, dtype: jnp.zeros((rows,), dtype)  # noqa: E731
  slot_state = SlotState(
    cache=fresh_cache(model, s, w + n),
    last_token=zeros(s, jnp.int32),
    position=zeros(s, jnp.int32),
    tokens=jnp.full((s, n), pad_id, jnp.int32),
    logprobs=jnp.zeros((s, n), jnp.float32),
    length=zeros(s, jnp.int32),
    budget=zeros(s, jnp.int32),
    pslot=zeros(s, jnp.int32),
    live=zeros(s, jnp.bool_),
    wait=jnp.full((s,), -1, jnp.int32),
    tag=jnp.full((s,), -1, jnp.int32),
  )
  lane_state = LaneState(
    cache=fresh_cache(model, lanes, w + n),
    prompt=jnp.full((lanes, w), pad_id, jnp.int32),
    plen=jnp.ones((lanes,), jnp.int32),
    chunk=zeros(lanes, jnp.int32),
    pslot=zeros(lanes, jnp.int32),
    active=zeros(lanes, jnp.bool_),
  )
  return slot_state, lane_state
