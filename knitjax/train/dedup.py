"""Encoder deduplication: each unique image encoded once per mini-batch, exact gradients.

In GRPO each prompt is answered G times, so a mini-batch of R rows holds only U << R distinct
images (fewer still when groups share an image). The naive step re-encodes every row's image in
every micro-batch: R encoder forwards and K encoder backwards (one per micro-batch). Here:

1. The U unique images are encoded once (`jax.vjp` of the encoder: features [U, P, D] plus the
   residuals of their backward pass).
2. Every backbone micro-batch gathers its rows' features with `dedup_gather`, a `jax.custom_vjp`
   whose backward scatter-adds each row's cotangent into its unique row (rows without an image,
   index -1, get zeros and send nothing back).
3. The backbone's gradient w.r.t. the unique features is accumulated (float32) across all K
   micro-batches of the mini-batch, next to the backbone's own gradient (the scan every train
   step shares, `knitjax.train.accumulation`).
4. One encoder backward, with the accumulated cotangent, gives the encoder's gradient.

Because the encoder's backward is linear in its cotangent, step 4 returns exactly the sum of the
K per-micro-batch encoder gradients of the naive step (up to float32 summation order): the encoder
gets the gradient it would have received from every backbone micro-batch.

Memory: step 1 keeps the encoder's residuals for U images alive across the backbone scan. With
`remat=True` the encoder is wrapped in `jax.checkpoint`, so only its inputs are kept and step 4
recomputes the forward (one extra encoder forward of U images, still U instead of R).

Counts: every encoder application goes through `apply_encoder`, which returns its counts next to
its features (see COUNT_KEYS). They are values of the program, not host state: a call site adds
its image count to a float32 scalar each time it executes (a call inside a `lax.scan` body adds
per iteration through the carry), and the backward pass is counted by `_count_backward`, an
identity `custom_vjp` on the encoder's params whose backward emits the counts as the cotangent of
a zero "probe" argument. That rule runs exactly when the encoder's backward runs (once per
executed backward: a frozen encoder, like the reference model's, gets none), and cotangents add
up over every backward that ran, so the probe's gradient is the number of encoder backwards (and
of the images they took).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from knitjax.train import accumulation

PyTree = Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather(num_unique: int, unique_u: jax.Array, index_b: jax.Array) -> jax.Array:
  del num_unique
  keep = (index_b >= 0).reshape(index_b.shape + (1,) * (unique_u.ndim - 1))
  rows = jnp.take(unique_u, jnp.maximum(index_b, 0), axis=0)
  return jnp.where(keep, rows, jnp.zeros((), unique_u.dtype))


def _gather_fwd(num_unique, unique_u, index_b):
  return _gather(num_unique, unique_u, index_b), index_b


def _gather_bwd(num_unique, index_b, ct_b):
  keep = (index_b >= 0).reshape(index_b.shape + (1,) * (ct_b.ndim - 1))
  ct_b = jnp.where(keep, ct_b, jnp.zeros((), ct_b.dtype))
  # Scatter-add: a unique row's cotangent is the sum over every row that uses it.
  ct_u = jax.ops.segment_sum(ct_b, jnp.maximum(index_b, 0), num_segments=num_unique)
  return ct_u, None


_gather.defvjp(_gather_fwd, _gather_bwd)


def dedup_gather(unique_u: jax.Array, index_b: jax.Array) -> jax.Array:
  """Rows `unique_u[index_b]` (zeros where `index_b == -1`); backward scatter-adds into `unique_u`.

  Args:
    unique_u: [U, ...] per-unique-image values (e.g. projected patch features).
    index_b: int [B], each row's index into `unique_u`, or -1 for a row without image.

  Returns:
    [B, ...] rows. The cotangent w.r.t. `unique_u` is `segment_sum(ct, index_b, U)`.
  """
  return _gather(unique_u.shape[0], unique_u, index_b)


# Per mini-batch counts of what the encoder ran, float32 scalars:
COUNT_KEYS = (
  "encoder_images_encoded",  # images through any encoder forward: policy, reference, recomputed
  "encoder_images_ref",  # of which the frozen reference model's encoder
  "encoder_images_recomputed",  # of which rematerialised in a backward (`remat`)
  "encoder_backward_passes",  # encoder backwards that ran
  "encoder_images_backward",  # images through those backwards
)
Counts = dict[str, jax.Array]


def zero_counts() -> Counts:
  """Every count at 0; also the probe whose cotangent counts encoder backwards."""
  return {k: jnp.zeros((), jnp.float32) for k in COUNT_KEYS}


def add_counts(a: Counts, b: Counts) -> Counts:
  return {k: a[k] + b[k] for k in COUNT_KEYS}


def _counts(**values: int) -> Counts:
  return {k: jnp.asarray(values.get(k, 0), jnp.float32) for k in COUNT_KEYS}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _count_backward(enc_params: PyTree, probe: Counts, tally: tuple[int, bool]) -> PyTree:
  del probe, tally
  return enc_params


def _count_backward_fwd(enc_params, probe, tally):
  del probe, tally
  return enc_params, None


def _count_backward_bwd(tally, _, ct_params):
  # Runs once per executed encoder backward: the params' cotangent passes through unchanged and
  # the probe's cotangent carries this backward's counts.
  num_images, remat = tally
  recomputed = num_images if remat else 0
  probe_ct = _counts(
    encoder_images_encoded=recomputed,
    encoder_images_recomputed=recomputed,
    encoder_backward_passes=1,
    encoder_images_backward=num_images,
  )
  return ct_params, probe_ct


_count_backward.defvjp(_count_backward_fwd, _count_backward_bwd)


def apply_encoder(
  encode_fn: Callable[[PyTree, jax.Array], jax.Array],
  enc_params: PyTree,
  images: jax.Array,
  *,
  probe: Counts | None = None,
  remat: bool = False,
  reference: bool = False,
) -> tuple[jax.Array, Counts]:
  """`encode_fn(enc_params, images)` and the counts of this execution of the call.

  Args:
    encode_fn: `(enc_params, images [N, ...]) -> features [N, ...]`.
    enc_params: its params.
    images: the N images it encodes.
    probe: `zero_counts()` passed in as a differentiated argument, when the encoder is trained:
      the cotangent it receives holds the backward counts (`encoder_backward_passes`,
      `encoder_images_backward`, and with `remat` the recomputed forward). None: no backward
      is counted (a frozen encoder).
    remat: wrap the encoder in `jax.checkpoint` (its backward recomputes the forward).
    reference: the frozen reference model's encoder (counted in `encoder_images_ref` too).

  Returns:
    `(features, forward counts)`: N images encoded, per execution of this call.
  """
  n = images.shape[0]
  if probe is not None:
    enc_params = _count_backward(enc_params, probe, (n, remat))
  fn = jax.checkpoint(encode_fn) if remat else encode_fn
  counts = _counts(encoder_images_encoded=n, encoder_images_ref=n if reference else 0)
  return fn(enc_params, images), counts


def encode_once(
  encode_fn: Callable[[PyTree, jax.Array], jax.Array],
  enc_params: PyTree,
  images_u: jax.Array,
  *,
  remat: bool = False,
) -> tuple[jax.Array, Counts, Callable[[jax.Array], tuple[PyTree, Counts]]]:
  """Encodes the unique images once; returns (features, forward counts, backward).

  `backward(cotangent)` returns the encoder grads and the counts of that backward. With `remat`,
  the encoder's activations are not kept: the backward recomputes them.
  """

  def encode(p, probe):
    return apply_encoder(encode_fn, p, images_u, probe=probe, remat=remat)

  feats_u, vjp_fn, counts = jax.vjp(encode, enc_params, zero_counts(), has_aux=True)

  def backward(ct_u: jax.Array) -> tuple[PyTree, Counts]:
    return vjp_fn(ct_u.astype(feats_u.dtype))

  return feats_u, counts, backward


def dedup_value_and_grad(
  encode_fn: Callable[[PyTree, jax.Array], jax.Array],
  backbone_loss: Callable[[PyTree, jax.Array, dict], tuple[jax.Array, dict]],
  enc_params: PyTree,
  backbone_params: PyTree,
  images_u: jax.Array,
  micro_batches: dict[str, jax.Array],
  *,
  remat: bool = False,
) -> tuple[jax.Array, dict, PyTree, PyTree, Counts]:
  """Loss and gradients of a mini-batch whose micro-batches share U unique images.

  Args:
    encode_fn: `(enc_params, images [N, ...]) -> features [N, ...]` (encoder + projector).
    backbone_loss: `(backbone_params, feats_u, micro_batch) -> (loss, metric sums)`; it reads its
      rows' features with `dedup_gather(feats_u, micro_batch[...])`.
    enc_params: encoder-side params (differentiated through one backward).
    backbone_params: backbone params.
    images_u: the mini-batch's unique images.
    micro_batches: `[K, ...]` arrays, scanned over the leading axis.
    remat: rematerialise the encoder in the backward instead of keeping its residuals.

  Returns:
    `(loss, metric sums, encoder grads, backbone grads, counts)`: loss and sums added over the K
    micro-batches; counts (COUNT_KEYS) of the encoder forward and backward that ran here.
  """
  feats_u, fwd_counts, backward = encode_once(encode_fn, enc_params, images_u, remat=remat)
  # The features' cotangent accumulates in float32 even when they are bfloat16.
  loss, sums, g_backbone, ct_feats = accumulation.value_and_grad(
    backbone_loss, backbone_params, feats_u, micro_batches
  )
  g_enc, bwd_counts = backward(ct_feats)
  return loss, sums, g_enc, g_backbone, add_counts(fwd_counts, bwd_counts)
