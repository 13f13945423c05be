"""The jitted step of continuous batching: chunked prefill lanes interleaved with slot decoding.

A new prompt does not stall the live slots for its whole prefill. It goes to a *prefill lane*
(a cache row of its own) and is prefilled one chunk of ``chunk`` tokens per iteration, inside the
same `lax.while_loop` that decodes the live slots; only chunks that hold prompt tokens run (a
short prompt left-padded to a long width skips its padding chunks). When a lane's last chunk is
in, its cache row is copied to every slot that waits on it and each of those slots samples its
own first token from the lane's last logits: a group's ``G`` samples share one prefill (prefix
sharing) and go live in the same iteration, which then decodes them with the rest.

A finished sample leaves its slot the iteration it ends, into the call's outbox (one row per
slot: a call ends each slot's sample at most once), from which the host reads back only the rows
filled.

Everything runs inside `jax.shard_map` over the batch axes: slots and lanes are split over the
shards (each shard prefills only the lanes whose slots it owns, nothing is replicated), and
sampling needs no collective. The only collective is one small sum per iteration (busy slots and
lanes), so all shards stop together: after ``decode_steps`` iterations, when nothing is live or
prefilling, or once a group of ``stop_free`` samples could start (that many free slots and a
free lane; after at least one iteration).
With several param slots (adoption of new versions for new groups only) each iteration decodes
the live rows of each param slot with that slot's parameters, split by version: a slot's rows are
gathered into the smallest bucket (a power-of-two fraction of the shard's slots) that holds them,
so a version transition that leaves a few rows on the old version costs a pass over a few rows,
not a second pass over every slot (``rows`` counts what the passes computed;
`knitjax.rollout.version_split`). Prefill lanes run one pass per param slot with active lanes.

A slot's cache row: positions ``[0, Pp)`` hold the left-padded prompt (``Pp``: the
prompt width rounded up to whole chunks), decoding appends from ``Pp``; RoPE positions count real
tokens only, so the result equals one whole-prompt prefill of the same prompt.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from knitjax import sharding
from knitjax.rollout.engine_state import (
  CallStats,
  LaneState,
  Outbox,
  SlotState,
  Starts,
  fresh_cache,
)

# The batched sampler's draw (top-k / top-p / temperature, untruncated log-probs): one rule.
from knitjax.rollout.sampler import _sample, is_eos
from knitjax.rollout.version_split import gather_rows, per_param_slot, select_rows, split_by_version

_FIRST_KEY = 1 << 30  # fold_in data of first-token draws, apart from the decode iterations


def _engine_shard(
  params,
  state,
  lanes,
  starts,
  rng,
  stop_free,
  decode_steps,
  *,
  graphdef,
  sampling,
  eos_ids,
  pad_id,
  chunk,
  split_versions=True,
):
  """One engine call on one batch shard (one scalar psum per iteration, nothing else).

  ``split_versions=False`` decodes every slot once per param slot with live rows (the rule
  before version splitting; kept for the engine benchmark's A/B).
  """
  axes = sharding.BATCH_AXES
  rng = jax.random.fold_in(rng, jax.lax.axis_index(axes))
  n_local, n_new = state.tokens.shape
  n_lanes, width = lanes.prompt.shape
  n_chunks = width // chunk
  rows = jnp.arange(n_local)
  models = [nnx.merge(graphdef, p) for p in params]

  def varying(x):  # device-varying over the batch axes (cond branches must agree on it)
    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  # ---- start: new prompts into their lanes, their slots waiting (no compute) ------------------
  fresh = fresh_cache(models[0], n_lanes, width + n_new)
  fresh = jax.tree.map(varying, fresh)

  def start(args):
    """Lanes ``starts.new`` take their prompts; slots ``starts.wait >= 0`` wait on their lane."""
    st, ln = args
    new, joins = starts.new, starts.wait >= 0
    first = (width - starts.plen) // chunk  # chunks of padding only are skipped
    ln = LaneState(
      cache=select_rows(new, dataclasses.replace(fresh, index=first * chunk), ln.cache),
      prompt=jnp.where(new[:, None], starts.prompt, ln.prompt),
      plen=jnp.where(new, starts.plen, ln.plen),
      chunk=jnp.where(new, first, ln.chunk),
      pslot=jnp.where(new, starts.pslot, ln.pslot),
      active=ln.active | new,
    )
    st = dataclasses.replace(
      st,
      wait=jnp.where(joins, starts.wait, st.wait),
      budget=jnp.where(joins, starts.budget, st.budget),
      tag=jnp.where(joins, starts.tag, st.tag),
      live=st.live & ~joins,
    )
    return st, ln

  state, lanes = jax.lax.cond(jnp.any(starts.new), start, lambda a: a, (state, lanes))

  # ---- the outbox: a finished sample leaves its slot at once --------------------------------
  # Every sample a call ends held a slot when the call began or started in it: one row per slot.
  n_out = n_local

  def emit(out, st, ended):
    def run(args):
      out, st = args
      dest = jnp.where(ended, out.count[0] + jnp.cumsum(ended) - 1, n_out)  # n_out: dropped
      put = lambda buf, x: buf.at[dest].set(x, mode="drop")  # noqa: E731
      out = Outbox(
        tokens=put(out.tokens, st.tokens),
        logprobs=put(out.logprobs, st.logprobs),
        length=put(out.length, st.length),
        tag=put(out.tag, st.tag),
        count=out.count + jnp.sum(ended),
      )
      return out, dataclasses.replace(st, tag=jnp.where(ended, -1, st.tag))

    return jax.lax.cond(jnp.any(ended), run, lambda a: a, (out, st))

  # ---- one iteration: a prefill chunk per active lane, first tokens, one decode pass ----------
  def chunk_inputs(ln):
    """Tokens, RoPE positions and validity [L, chunk] of each lane's next chunk."""

    def one(prompt, plen, k):
      at = k * chunk + jnp.arange(chunk)
      pad = width - plen
      toks = jax.lax.dynamic_slice(prompt, (k * chunk,), (chunk,))
      return toks, jnp.maximum(at - pad, 0), at >= pad

    return jax.vmap(one)(ln.prompt, ln.plen, ln.chunk)

  def prefill_chunk(model, ln):
    def one(toks, pos, valid, cache):
      logits, cache = model.prefill(toks[None], pos[None], valid[None], cache)
      return logits[0], cache

    return jax.vmap(one)(*chunk_inputs(ln), ln.cache)

  def lane_pass(ln):
    vocab = models[0].config.vocab_size
    init = (varying(jnp.zeros((n_lanes, vocab), jnp.float32)), ln.cache)
    logits, cache = per_param_slot(
      models, ln.pslot, ln.active, lambda m: prefill_chunk(m, ln), init
    )
    ln = dataclasses.replace(ln, cache=cache, chunk=ln.chunk + ln.active)
    return ln, logits

  def go_live(it, st, ln, logits_l, done_l, out):
    lane = jnp.clip(st.wait, 0, n_lanes - 1)
    take = (st.wait >= 0) & done_l[lane]

    def run(st):
      token, logp = _sample(logits_l[lane], jax.random.fold_in(rng, _FIRST_KEY + it), sampling)
      first_tokens = jnp.full((n_local, n_new), pad_id, jnp.int32).at[:, 0].set(token)
      first_logps = jnp.zeros((n_local, n_new), jnp.float32).at[:, 0].set(logp)
      new = SlotState(
        cache=jax.tree.map(lambda c: c[lane], ln.cache),
        last_token=token,
        position=ln.plen[lane],
        tokens=first_tokens,
        logprobs=first_logps,
        length=jnp.ones_like(token),
        budget=st.budget,
        pslot=ln.pslot[lane],
        live=~is_eos(token, eos_ids) & (st.budget > 1),
        wait=jnp.full_like(st.wait, -1),
        tag=st.tag,
      )
      return select_rows(take, new, st)

    st = jax.lax.cond(jnp.any(take), run, lambda s: s, st)
    return emit(out, st, take & ~st.live)  # a first token that ends the sample

  def decode_rows(model, st, rows=None):
    """Logits and caches of the slot ``rows`` (None: every slot) after one decode step."""
    step = lambda t, q, c: model.decode_step(t[None], q[None], c)  # noqa: E731
    args = (st.last_token, st.position, st.cache)
    logits, cache = jax.vmap(step)(*(args if rows is None else gather_rows(rows, args)))
    return logits[:, 0], cache

  def decode(it, st):
    vocab = models[0].config.vocab_size
    init = (varying(jnp.zeros((n_local, vocab), jnp.float32)), st.cache)
    if len(models) == 1:
      logits, cache = decode_rows(models[0], st)
      computed = unsplit = jnp.asarray(n_local, jnp.int32)
    elif not split_versions:
      logits, cache = per_param_slot(models, st.pslot, st.live, lambda m: decode_rows(m, st), init)
      computed = unsplit = n_local * sum(
        jnp.any(st.live & (st.pslot == v)) for v in range(len(models))
      ).astype(jnp.int32)
    else:
      (logits, cache), computed, unsplit = split_by_version(
        models, st.pslot, st.live, lambda m, rows: decode_rows(m, st, rows), init
      )
    return advance(it, st, logits, cache, jnp.stack([computed, unsplit]))

  def advance(it, st, logits, cache, counts):
    """The live slots' next tokens drawn from ``logits``; ``cache``: the pass's caches."""
    token, logp = _sample(logits, jax.random.fold_in(rng, it), sampling)
    live = st.live
    col = jnp.minimum(st.length, n_new - 1)
    length = st.length + live
    ended = is_eos(token, eos_ids) | (length >= st.budget)
    return (
      dataclasses.replace(
        st,
        cache=cache,  # rows not live: their cache row is replaced before they go live again
        last_token=jnp.where(live, token, st.last_token),
        position=st.position + live,
        tokens=st.tokens.at[rows, col].set(jnp.where(live, token, st.tokens[rows, col])),
        logprobs=st.logprobs.at[rows, col].set(jnp.where(live, logp, st.logprobs[rows, col])),
        length=length,
        live=live & ~ended,
      ),
      live & ended,
      varying(counts),
    )

  def busy(st, ln):
    # One all-reduce: live slots, slots waiting for a lane, active lanes (engine-wide).
    local = jnp.stack([jnp.sum(st.live), jnp.sum(st.wait >= 0), jnp.sum(ln.active)])
    return jax.lax.psum(local.astype(jnp.int32), axes)

  n_total = n_local * jax.lax.axis_size(axes)
  n_lanes_total = n_lanes * jax.lax.axis_size(axes)

  def cond(carry):
    it, st, ln, _, _ = carry
    live, waiting, active = busy(st, ln)
    # Stop as soon as the engine as a whole could start a group of `stop_free` samples that the
    # host holds: that many free slots and a free lane (after one
    # iteration, so a caller that cannot start one still moves; stopping while every lane is busy
    # would only return to the host for nothing).
    room = (n_total - live - waiting >= stop_free) & (active < n_lanes_total)
    enough = (stop_free > 0) & room & (it > 0)
    going = (live > 0) | (active > 0)
    return (it < decode_steps) & going & ~enough

  def tally(stats, decoded, *, chunked, counts):
    """The call's counters after one more iteration (``chunked``: a prefill chunk pass ran)."""
    return dataclasses.replace(
      stats,
      iterations=stats.iterations + 1,
      decode_passes=stats.decode_passes + decoded,
      chunk_passes=stats.chunk_passes + chunked,
      rows=stats.rows + counts[0],
      rows_unsplit=stats.rows_unsplit + counts[1],
    )

  def body(carry):
    it, st, ln, out, stats = carry
    any_lane = jnp.any(ln.active)
    ln, logits_l = jax.lax.cond(
      any_lane,
      lane_pass,
      lambda ln: (ln, varying(jnp.zeros((n_lanes, models[0].config.vocab_size), jnp.float32))),
      ln,
    )
    done_l = ln.active & (ln.chunk >= n_chunks)
    out, st = go_live(it, st, ln, logits_l, done_l, out)
    ln = dataclasses.replace(ln, active=ln.active & ~done_l)
    any_live = jnp.any(st.live)
    st, ended, counts = jax.lax.cond(
      any_live,
      lambda s: decode(it, s),
      lambda s: (s, varying(jnp.zeros(n_local, jnp.bool_)), varying(jnp.zeros(2, jnp.int32))),
      st,
    )
    out, st = emit(out, st, ended)
    return it + 1, st, ln, out, tally(stats, any_live, chunked=any_lane, counts=counts)

  zero = varying(jnp.zeros((), jnp.int32))
  stats0 = CallStats(zero, zero, zero, zero, zero)
  out0 = Outbox(
    tokens=varying(jnp.full((n_out, n_new), pad_id, jnp.int32)),
    logprobs=varying(jnp.zeros((n_out, n_new), jnp.float32)),
    length=varying(jnp.zeros((n_out,), jnp.int32)),
    tag=varying(jnp.full((n_out,), -1, jnp.int32)),
    count=varying(jnp.zeros((1,), jnp.int32)),
  )
  _, state, lanes, out, stats = jax.lax.while_loop(
    cond, body, (jnp.zeros((), jnp.int32), state, lanes, out0, stats0)
  )
  # The slots' samples and the busy lanes after the call, apart from the state (which the next
  # call takes over, donated): the host reads them when it collects this call.
  after = (state.tag, lanes.active)
  return state, lanes, out, jax.tree.map(lambda x: x[None], stats), after


def make_engine_call(*, graphdef, mesh, sampling, eos_ids, pad_id, chunk, split_versions=True):
  """The jitted engine call with its static settings bound once (hashing a `GraphDef` as a
  static argument on every call costs about a millisecond on the host)."""
  fn = functools.partial(
    engine_call,
    graphdef=graphdef,
    mesh=mesh,
    sampling=sampling,
    eos_ids=eos_ids,
    pad_id=pad_id,
    chunk=chunk,
    split_versions=split_versions,
  )
  return jax.jit(fn, donate_argnums=(1, 2))


def engine_call(
  params,
  state,
  lanes,
  starts,
  rng,
  stop_free,
  decode_steps,
  *,
  graphdef,
  mesh,
  sampling,
  eos_ids,
  pad_id,
  chunk,
  split_versions=True,
):
  batch, rep = PartitionSpec(sharding.BATCH_AXES), PartitionSpec()
  fn = functools.partial(
    _engine_shard,
    graphdef=graphdef,
    sampling=sampling,
    eos_ids=eos_ids,
    pad_id=pad_id,
    chunk=chunk,
    split_versions=split_versions,
  )
  starts_spec = Starts(
    prompt=batch, plen=batch, new=batch, pslot=rep, wait=batch, budget=batch, tag=batch
  )
  return jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=(rep, batch, batch, starts_spec, rep, rep, rep),
    out_specs=(batch, batch, batch, batch, (batch, batch)),
  )(params, state, lanes, starts, rng, stop_free, decode_steps)
