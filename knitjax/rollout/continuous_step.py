"""The jitted step of continuous batching: refill free slots, then decode all of them.

One call (fixed shapes) prefills up to ``refill_rows`` new prompts into free slots, sampling
their first token from the prefill logits (skipped by `lax.cond` when nothing is refilled), then
runs a `lax.while_loop` of decode iterations over all slots that stops after ``decode_steps``
iterations, when no slot is live, or once ``stop_free`` slots are free (after at least one
iteration). Each slot has its own KV cache row, RoPE position and budget: the model's one-index
`KVCache` vmapped over slots, so sequences at different positions decode together.

Everything runs inside `jax.shard_map` over the batch axes, so sampling never needs a
collective; each shard owns ``slots / shards`` slots. The only collective is one scalar sum per
iteration (live slots), so all shards stop together once the engine as a whole has
``stop_free`` free slots. The refill rows are replicated: every shard prefills them and keeps those
that land in its slots. With several param slots (adoption of new versions for new groups only)
each iteration runs one decode pass per param slot with live samples.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from knitjax import sharding

# The batched sampler's draw (top-k / top-p / temperature, untruncated log-probs): one rule.
from knitjax.rollout.sampler import _sample, is_eos

_REFILL_KEY = 1 << 30  # fold_in data of the refill draw, apart from the decode iterations


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


def fresh_cache(model, rows: int, max_len: int):
  return jax.vmap(lambda _: model.init_cache(1, max_len))(jnp.arange(rows))


def _engine_shard(
  params,
  prefill_params,
  state,
  refill,
  rng,
  stop_free,
  decode_steps,
  *,
  graphdef,
  sampling,
  eos_ids,
  pad_id,
):
  """One engine call on one batch shard (inside shard_map: no collectives)."""
  shard = jax.lax.axis_index(sharding.BATCH_AXES)
  rng = jax.random.fold_in(rng, shard)
  n_local = state.length.shape[0]
  n_new = state.tokens.shape[1]
  rows = jnp.arange(n_local)
  slot_r, prompts_rp, plens_r, budget_r, valid_r, pslot = refill
  local_r = slot_r - shard * n_local
  keep_r = valid_r & (local_r >= 0) & (local_r < n_local)
  idx_r = jnp.where(keep_r, local_r, n_local)  # out of range: dropped by the scatters

  def do_refill(st: SlotState) -> SlotState:
    model = nnx.merge(graphdef, prefill_params)
    r, p = prompts_rp.shape
    valid_rp = jnp.arange(p)[None, :] >= (p - plens_r)[:, None]
    pos_rp = jnp.maximum(jnp.cumsum(valid_rp, axis=1) - 1, 0)
    cache_r = fresh_cache(model, r, p + n_new)
    prefill = lambda t, q, v, c: model.prefill(t[None], q[None], v[None], c)  # noqa: E731
    logits_r, cache_r = jax.vmap(prefill)(prompts_rp, pos_rp, valid_rp, cache_r)
    token_r, logp_r = _sample(logits_r[:, 0], jax.random.fold_in(rng, _REFILL_KEY), sampling)
    put = lambda a, x: a.at[idx_r].set(x, mode="drop")  # noqa: E731
    first_tokens = jnp.full((r, n_new), pad_id, jnp.int32).at[:, 0].set(token_r)
    first_logps = jnp.zeros((r, n_new), jnp.float32).at[:, 0].set(logp_r)
    return SlotState(
      cache=jax.tree.map(put, st.cache, cache_r),
      last_token=put(st.last_token, token_r),
      position=put(st.position, plens_r),
      tokens=put(st.tokens, first_tokens),
      logprobs=put(st.logprobs, first_logps),
      length=put(st.length, jnp.ones_like(plens_r)),
      budget=put(st.budget, budget_r),
      pslot=put(st.pslot, jnp.full_like(plens_r, pslot)),
      live=put(st.live, ~is_eos(token_r, eos_ids) & (budget_r > 1)),
    )

  state = jax.lax.cond(jnp.any(keep_r), do_refill, lambda st: st, state)
  n_total = n_local * jax.lax.axis_size(sharding.BATCH_AXES)
  models = [nnx.merge(graphdef, p) for p in params]

  def decode_rows(model, st):
    step = lambda t, q, c: model.decode_step(t[None], q[None], c)  # noqa: E731
    logits, cache = jax.vmap(step)(st.last_token, st.position, st.cache)
    return logits[:, 0], cache

  def cond(carry):
    it, st = carry
    # One scalar all-reduce per iteration: every shard stops at the same iteration, as soon as
    # the whole engine has `stop_free` free slots (one shard's share would leave slots idle).
    live = jax.lax.psum(jnp.sum(st.live, dtype=jnp.int32), sharding.BATCH_AXES)
    # At least one iteration per call, so a caller that cannot use the free slots still moves.
    enough = (stop_free > 0) & (n_total - live >= stop_free) & (it > 0)
    return (it < decode_steps) & (live > 0) & ~enough

  def body(carry):
    it, st = carry
    if len(models) == 1:
      logits, cache = decode_rows(models[0], st)
    else:  # one pass per param slot with live samples; rows take their own slot's results
      logits = jnp.zeros((n_local, models[0].config.vocab_size), jnp.float32)
      logits = jax.lax.pcast(logits, sharding.BATCH_AXES, to="varying")
      cache = st.cache
      for v, model in enumerate(models):
        sel = st.live & (st.pslot == v)

        def run(args, model=model, sel=sel):
          lg, cc = decode_rows(model, st)
          pick = lambda new, old: jnp.where(  # noqa: E731
            sel.reshape(sel.shape + (1,) * (new.ndim - 1)), new, old
          )
          return pick(lg, args[0]), jax.tree.map(pick, cc, args[1])

        logits, cache = jax.lax.cond(jnp.any(sel), run, lambda a: a, (logits, cache))
    token, logp = _sample(logits, jax.random.fold_in(rng, it), sampling)
    live = st.live
    col = jnp.minimum(st.length, n_new - 1)
    tokens = st.tokens.at[rows, col].set(jnp.where(live, token, st.tokens[rows, col]))
    logprobs = st.logprobs.at[rows, col].set(jnp.where(live, logp, st.logprobs[rows, col]))
    length = st.length + live
    ended = is_eos(token, eos_ids) | (length >= st.budget)
    return it + 1, SlotState(
      cache=cache,
      last_token=jnp.where(live, token, st.last_token),
      position=st.position + live,
      tokens=tokens,
      logprobs=logprobs,
      length=length,
      budget=st.budget,
      pslot=st.pslot,
      live=live & ~ended,
    )

  steps, state = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))
  return state, steps[None]


@functools.partial(
  jax.jit, static_argnames=("graphdef", "mesh", "sampling", "eos_ids", "pad_id"), donate_argnums=2
)
def engine_call(
  params,
  prefill_params,
  state,
  refill,
  rng,
  stop_free,
  decode_steps,
  *,
  graphdef,
  mesh,
  sampling,
  eos_ids,
  pad_id,
):
  batch, rep = PartitionSpec(sharding.BATCH_AXES), PartitionSpec()
  fn = functools.partial(
    _engine_shard, graphdef=graphdef, sampling=sampling, eos_ids=eos_ids, pad_id=pad_id
  )
  return jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=(rep, rep, batch, rep, rep, rep, rep),
    out_specs=(batch, batch),
  )(params, prefill_params, state, refill, rng, stop_free, decode_steps)
