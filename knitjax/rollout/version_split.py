"""Row selection for the engine's decode passes: per param slot (policy version), each version's
live rows gathered into the smallest bucket that holds them (`knitjax.rollout.continuous_step`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def select_rows(mask, new, old):
  """Rows of ``new`` where ``mask`` (leading axis), else ``old``; works on whole pytrees."""

  def pick(a, b):
    return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)

  return jax.tree.map(pick, new, old)


def per_param_slot(models, which, active, fn, init):
  """``fn(model)`` for the param slot of each row: one pass per param slot that has an active
  row (a `lax.cond` skips the others), rows keeping their own slot's result."""
  if len(models) == 1:
    return jax.lax.cond(jnp.any(active), lambda a: fn(models[0]), lambda a: a, init)
  out = init
  for v, model in enumerate(models):
    sel = active & (which == v)

    def run(acc, model=model, sel=sel):
      return select_rows(sel, fn(model), acc)

    out = jax.lax.cond(jnp.any(sel), run, lambda a: a, out)
  return out


def buckets(rows: int, levels: int = 4) -> tuple[int, ...]:
  """Row counts a version's decode pass may run on: ``rows / 2^k`` for ``k < levels``, rounded
  up, ascending and distinct (the last is ``rows``: every slot)."""
  return tuple(sorted({max(1, -(-rows // (1 << k))) for k in range(levels)}))


def gather_rows(idx, tree):
  return jax.tree.map(lambda x: x[idx], tree)


def split_by_version(models, which, active, fn, init):
  """``fn(model, rows)`` for the live rows of each param slot, each slot's rows gathered into its
  smallest bucket; returns the rows' results (``init`` where no slot ran), the rows computed, and
  the rows one pass over every row per slot with live rows would have computed (the old rule).

  ``fn(model, rows)`` maps a pytree of row arrays (leading axis: rows) to results with the same
  leading axis. A slot whose rows need every slot runs on all rows, without gathering.
  """
  n = which.shape[0]
  sizes = buckets(n)
  out, computed, unsplit = init, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
  for v, model in enumerate(models):
    sel = active & (which == v)
    count = jnp.sum(sel)
    # The slot's rows first (stable), then the others: idx[:size] holds all of them, and row r's
    # result sits at inv[r] of the bucket. Results come back by a gather and a select (XLA's
    # scatter into the full cache is much slower on the CPU).
    idx = jnp.argsort(~sel, stable=True)
    inv = jnp.argsort(idx)

    def bucket(acc, size, model=model, sel=sel, idx=idx, inv=inv):
      if size == n:
        return select_rows(sel, fn(model, None), acc)
      got = fn(model, idx[:size])
      back = jnp.minimum(inv, size - 1)  # rows not in the bucket: any index, not selected
      return select_rows(sel, gather_rows(back, got), acc)

    branches = [functools.partial(bucket, size=size) for size in sizes]
    pick = jnp.sum(jnp.asarray(sizes) < count)  # the smallest bucket holding `count` rows
    out = jax.lax.cond(
      count > 0, lambda a, pick=pick, br=branches: jax.lax.switch(pick, br, a), lambda a: a, out
    )
    computed += jnp.where(count > 0, jnp.asarray(sizes)[jnp.minimum(pick, len(sizes) - 1)], 0)
    unsplit += jnp.where(count > 0, n, 0)
  return out, computed, unsplit
