"""A mini-batch's loss and gradient summed over its micro-batches: every train step's one scan.

Every train step, text or VLM, in every layout, computes its mini-batch's gradient the same way:
:func:`value_and_grad` of ``loss_fn(params, once, micro_batch) -> (loss, aux)``, where ``once``
is what the mini-batch computes once for all its micro-batches:

- nothing (``()``) for padded, packed and shared-prompt rows (`knitjax.train.step`);
- the prompts' keys and values (`knitjax.train.prefix`: each prompt once per mini-batch);
- the unique images' features (`knitjax.train.dedup`: each image encoded once per mini-batch);
- the naive VLM step's count probe (`knitjax.train.dedup.apply_encoder`: its cotangent counts
  the encoder backwards that ran).

A ``lax.scan`` over the K micro-batches sums the loss, the aux (metric sums, encoder counts), the
params' gradient and the cotangent of ``once`` (in float32, whatever its dtype); the caller sends
that cotangent back once through what computed ``once`` (a ``jax.vjp``'s backward), which is
exact because that backward is linear in its cotangent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def accumulate(total: PyTree, ct: PyTree) -> PyTree:
  """``total + ct`` leaf by leaf, in float32 (a bfloat16 cotangent included)."""
  return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), total, ct)


def value_and_grad(
  loss_fn: Callable[[PyTree, PyTree, dict], tuple[jax.Array, PyTree]],
  params: PyTree,
  once: PyTree,
  micro_batches: dict[str, jax.Array],
) -> tuple[jax.Array, PyTree, PyTree, PyTree]:
  """Loss, aux, params' gradient and ``once``'s float32 cotangent, summed over micro-batches.

  Args:
    loss_fn: ``(params, once, micro_batch) -> (loss, aux)``; ``aux`` is summed (metric sums).
    params: the differentiated params.
    once: what the mini-batch computed once for every micro-batch (``()``: nothing).
    micro_batches: ``[K, ...]`` arrays, scanned over the leading axis.

  Returns:
    ``(loss, aux, grads, ct_once)``, each the sum over the K micro-batches.
  """
  grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)

  def body(carry, mb):
    grads, ct, loss_acc, aux_acc = carry
    (loss, aux), (g, g_once) = grad_fn(params, once, mb)
    grads = jax.tree.map(jnp.add, grads, g)
    aux_acc = jax.tree.map(jnp.add, aux_acc, aux)
    return (grads, accumulate(ct, g_once), loss_acc + loss, aux_acc), None

  first = jax.tree.map(lambda x: x[0], micro_batches)
  aux_shape = jax.eval_shape(lambda: loss_fn(params, once, first)[1])
  carry0 = (
    jax.tree.map(jnp.zeros_like, params),
    jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), once),
    jnp.zeros((), jnp.float32),
    jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape),
  )
  (grads, ct, loss, aux), _ = jax.lax.scan(body, carry0, micro_batches)
  return loss, aux, grads, ct
