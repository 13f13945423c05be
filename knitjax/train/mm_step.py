"""The multimodal train step: one optimizer update per mini-batch of a VLM.

A mini-batch arrives as the text step's ``[K, rows / K, T]`` arrays plus

- ``image_index`` ``[K, rows / K]`` int32: each row's index into ``images`` (-1: no image);
- ``images`` ``[U, H, W, C]`` uint8: the mini-batch's unique images (padded with blank images to
  a static count; the padding is encoded too, and counted).

Two code paths give the same loss and gradients (tests check 1e-5 relative, float32):

- naive (``encoder_dedup=False``), the baseline: ``images`` holds one image per row
  (:func:`prepare_batch` with ``row_images=True``, laid out so that each data-parallel shard holds
  its own rows' images), and every micro-batch runs encoder and backbone forward and backward on
  its rows' images, so a mini-batch encodes ``rows`` images and runs K encoder backwards. No image
  crosses devices: the baseline's cost is its transfer and its encoding, not an exchange in the
  step.
- dedup (``encoder_dedup=True``, :mod:`knitjax.train.dedup`): the U unique images are encoded once,
  the backbone micro-batches gather their rows' features and accumulate the cotangent for them,
  and one encoder backward ends the mini-batch. ``remat_encoder`` trades the encoder's kept
  activations for a recomputation.

Both report the encoder counts of :data:`knitjax.train.dedup.COUNT_KEYS` per mini-batch
(``encoder_images_encoded``, ``encoder_backward_passes``, ...), counted by the encoder calls that
ran: every encoder application, the reference model's included, goes through
:func:`~knitjax.train.dedup.apply_encoder`.

Shared prompts (:mod:`knitjax.train.prompt_sharing`, ``layout.prompt_sharing="group"``): a
sequence per group (its prompt once, then its responses, under the tree mask), ``image_index``
per sequence, so an image is encoded once per mini-batch (dedup) and its tokens pass the backbone
once per group instead of once per response.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from knitjax import sharding
from knitjax.models.vlm import split_params
from knitjax.train import accumulation, prefix
from knitjax.train.dedup import (
  add_counts,
  apply_encoder,
  dedup_gather,
  dedup_value_and_grad,
  encode_once,
  zero_counts,
)
from knitjax.train.prefix import split_micro_batches
from knitjax.train.step import (
  MICRO_BATCH_FIELDS,
  PREFIX_ROW_FIELDS,
  SHARED_FIELDS,
  StepHParams,
  TrainState,
  apply_gradients,
  jit_step,
  model_loss,
  normalizer,
  step_forward,
)

MM_ROW_FIELDS = (*MICRO_BATCH_FIELDS, "image_index")
# Shared prompts (knitjax.train.prompt_sharing): a sequence per group, its image once.
MM_SHARED_FIELDS = (*SHARED_FIELDS, "image_index")
# Prompts once per mini-batch (knitjax.train.prefix): rows that continue them; each prompt's image
# is in the prompt fields (prefix_image_index), the rows hold none.
MM_PREFIX_FIELDS = (*PREFIX_ROW_FIELDS, "image_index")


def _row_fields(batch) -> tuple[str, ...]:
  if prefix.INDEX_FIELD in batch:
    return MM_PREFIX_FIELDS
  return MM_SHARED_FIELDS if "score_index" in batch else MM_ROW_FIELDS


def _policy_loss(
  model, feats, mb, norm, hparams: StepHParams, ref_model=None, ref_feats=None, ref_mb=None
):
  """The step's loss (`knitjax.train.step.model_loss`) of a micro-batch whose image tokens read
  ``feats``, against the reference's log-probs when ``ref_model`` is given (``ref_mb``: the
  reference's view of ``mb``, its own prompt keys and values; None: ``mb``)."""
  if ref_model is not None:
    ref_in = mb if ref_mb is None else ref_mb
    ref_logp = step_forward(ref_model, ref_in, hparams, entropy="none", images=ref_feats)[0]
    mb = {**mb, "ref_logp": jax.lax.stop_gradient(ref_logp)}
  return model_loss(model, mb, norm, hparams, images=feats)


def _row_images(images, micro_batches: int):
  """``[K, rows / K, ...]``: the naive path's per-row images, from ``images`` laid out by
  :func:`prepare_batch` (``row_images=True``: micro-batch ``k``'s row ``j`` at ``j * K + k``, so a
  shard's contiguous block of ``images`` holds the images of its own columns of rows)."""
  rows = images.shape[0]
  return images.reshape(rows // micro_batches, micro_batches, *images.shape[1:]).swapaxes(0, 1)


def _encode_with(graphdef, backbone):
  """`(enc_params, images) -> features` of the VLM whose backbone params are `backbone`."""
  return lambda enc, images: nnx.merge(graphdef, enc, backbone).encode_images(images)


def _encode_ref(ref_params, images, *, graphdef):
  """The frozen reference model's features of `images` (no backward), and their counts."""
  return apply_encoder(
    lambda p, x: nnx.merge(graphdef, p).encode_images(x), ref_params, images, reference=True
  )


def _naive(params, rows, images, norm, *, graphdef, hparams, ref_params):
  """Encodes each row's own image in every micro-batch (the baseline)."""
  k, per_mb = rows["image_index"].shape[:2]
  if images.shape[0] != k * per_mb:
    raise ValueError(
      f"the naive multimodal step takes one image per row ({k * per_mb}), got {images.shape[0]}: "
      "lay the batch out with mm_step.prepare_batch(..., row_images=True)."
    )

  def mb_loss(p, probe, mb):
    model = nnx.merge(graphdef, p)
    images_b = mb["images"]
    counts = zero_counts()
    ref_model = ref_feats = None
    if ref_params is not None:
      ref_feats, counts = _encode_ref(ref_params, images_b, graphdef=graphdef)
      ref_model = nnx.merge(graphdef, ref_params)
    enc, backbone = split_params(p)
    feats, enc_counts = apply_encoder(_encode_with(graphdef, backbone), enc, images_b, probe=probe)
    loss, sums = _policy_loss(model, feats, mb, norm, hparams, ref_model, ref_feats)
    return loss, (sums, add_counts(counts, enc_counts))

  # The probe's cotangent: the counts of the encoder backwards that ran (dedup.apply_encoder).
  rows = {**rows, "images": _row_images(images, k)}
  loss, (sums, fwd_counts), grads, bwd_counts = accumulation.value_and_grad(
    mb_loss, params, zero_counts(), rows
  )
  return loss, sums, grads, add_counts(fwd_counts, bwd_counts)


def _dedup(params, rows, images_u, norm, *, graphdef, hparams, ref_params, remat):
  """Encodes each unique image once; see knitjax.train.dedup."""
  enc, backbone = split_params(params)

  ref_feats, ref_counts = None, zero_counts()
  if ref_params is not None:
    ref_feats, ref_counts = _encode_ref(ref_params, images_u, graphdef=graphdef)
    ref_feats = jax.lax.stop_gradient(ref_feats)

  def backbone_loss(backbone_params, feats_u, mb):
    model = nnx.merge(graphdef, enc, backbone_params)
    ref_model = ref_rows = None
    if ref_params is not None:
      ref_rows = dedup_gather(ref_feats, mb["image_index"])
      ref_model = nnx.merge(graphdef, ref_params)
    feats = dedup_gather(feats_u, mb["image_index"])
    return _policy_loss(model, feats, mb, norm, hparams, ref_model, ref_rows)

  loss, sums, g_enc, g_backbone, counts = dedup_value_and_grad(
    _encode_with(graphdef, backbone), backbone_loss, enc, backbone, images_u, rows, remat=remat
  )
  return loss, sums, nnx.merge_state(g_enc, g_backbone), add_counts(counts, ref_counts)


def _prefix(params, rows, images_u, prompts, norm, *, graphdef, hparams, ref_params, remat):
  """Each unique image encoded once and each prompt run once per mini-batch, its rows in any
  micro-batches (`knitjax.train.prefix`). The prompts' forward reads the images' features, the
  rows read only the prompts' keys and values: one vjp of (decoder params, features) -> keys
  and values, its cotangent accumulated over the micro-batches, then one encoder backward of the
  features' cotangent (`knitjax.train.dedup`)."""
  enc, backbone = split_params(params)
  image_u = prompts[prefix.PROMPT_IMAGE_FIELD]

  def kv_of(model, feats_u):
    k, v = model.keys_values(
      prompts["prefix_tokens"], prompts["prefix_positions"], prompts["prefix_valid"],
      image_rows_bpd=dedup_gather(feats_u, image_u),
    )  # fmt: skip
    return {"k": k, "v": v}

  ref_kv, ref_model, ref_counts = None, None, zero_counts()
  if ref_params is not None:
    ref_feats, ref_counts = _encode_ref(ref_params, images_u, graphdef=graphdef)
    ref_model = nnx.merge(graphdef, ref_params)
    ref_kv = jax.lax.stop_gradient(kv_of(ref_model, ref_feats))
  feats_u, fwd_counts, encoder_backward = encode_once(
    _encode_with(graphdef, backbone), enc, images_u, remat=remat
  )

  def loss_fn(p, kv_u, mb):
    ref_mb = None if ref_kv is None else prefix.attach(mb, ref_kv, prompts)
    model = nnx.merge(graphdef, enc, p[0])
    mb = prefix.attach(mb, kv_u, prompts)
    return _policy_loss(model, None, mb, norm, hparams, ref_model, None, ref_mb)

  loss, sums, (g_backbone, ct_feats) = prefix.value_and_grad(
    lambda p: kv_of(nnx.merge(graphdef, enc, p[0]), p[1]), loss_fn, (backbone, feats_u), rows
  )
  g_enc, bwd_counts = encoder_backward(ct_feats)
  counts = add_counts(add_counts(fwd_counts, bwd_counts), ref_counts)
  return loss, sums, nnx.merge_state(g_enc, g_backbone), counts


def mm_value_and_grad(
  params: nnx.State,
  batch: dict[str, jax.Array],
  *,
  graphdef: nnx.GraphDef,
  hparams: StepHParams,
  encoder_dedup: bool = True,
  remat_encoder: bool = False,
  ref_params: nnx.State | None = None,
) -> tuple[jax.Array, dict, nnx.State, dict[str, jax.Array]]:
  """Loss, metric sums, gradients and encoder counts of one multimodal mini-batch.

  Args:
    params: the VLM's params (vision, projector, lm).
    batch: ``[K, rows / K, ...]`` row fields with ``image_index``, and ``images`` ``[U, ...]``.
    graphdef: the VLM's graph definition.
    hparams: loss settings, sampling temperature, response budget.
    encoder_dedup: encode unique images once (True) or every row's own image per micro-batch
      (False: ``images`` holds one image per row, `prepare_batch` with ``row_images=True``).
    remat_encoder: (dedup only) recompute the encoder in its backward instead of keeping it.
    ref_params: frozen reference policy, used when ``hparams.loss.kl_coef > 0``.

  Returns:
    ``(loss, metric sums, grads, counts)``, summed over the micro-batches.
  """
  norm = normalizer(batch, hparams)
  rows = {k: batch[k] for k in _row_fields(batch)}
  if ref_params is not None and hparams.loss.kl_coef <= 0:
    ref_params = None
  kwargs = dict(graphdef=graphdef, hparams=hparams, ref_params=ref_params)
  _, prompts = prefix.split(batch)
  if prompts is not None:
    if not encoder_dedup:
      raise ValueError("prompts once per mini-batch take each unique image once: encoder_dedup.")
    return _prefix(params, rows, batch["images"], prompts, norm, remat=remat_encoder, **kwargs)
  if encoder_dedup:
    return _dedup(params, rows, batch["images"], norm, remat=remat_encoder, **kwargs)
  return _naive(params, rows, batch["images"], norm, **kwargs)


def mm_train_step(
  state: TrainState,
  batch: dict[str, jax.Array],
  *,
  graphdef: nnx.GraphDef,
  optimizer: optax.GradientTransformation,
  hparams: StepHParams,
  encoder_dedup: bool = True,
  remat_encoder: bool = False,
  ref_params: nnx.State | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """Applies one optimizer update from a multimodal mini-batch (see the module docstring).

  Advantages come from the host: the critic (GAE) and the KL as a reward are text-only.
  """
  if hparams.advantages_in_step:
    raise ValueError(
      "the VLM step takes host advantages only; use advantage 'grpo', 'drgrpo' or 'rloo' with "
      "kl_penalty 'loss'."
    )
  loss, sums, grads, counts = mm_value_and_grad(
    state.params,
    batch,
    graphdef=graphdef,
    hparams=hparams,
    encoder_dedup=encoder_dedup,
    remat_encoder=remat_encoder,
    ref_params=ref_params,
  )
  return apply_gradients(state, optimizer, loss, grads, {**counts, **sums})


def batch_shardings(
  mesh: jax.sharding.Mesh, *, shared: bool = False, prefixed: bool = False
) -> dict[str, NamedSharding]:
  """Row fields ``[K, rows, ...]`` split on rows; images ``[U, ...]`` split over the batch axes.

  ``shared``: the fields of shared-prompt sequences (``MM_SHARED_FIELDS``); ``prefixed``: rows
  that continue their prompts (``MM_PREFIX_FIELDS``), the prompts split over the batch axes."""
  rows = sharding.logical_sharding(mesh, (None, "batch"))
  fields = MM_PREFIX_FIELDS if prefixed else MM_SHARED_FIELDS if shared else MM_ROW_FIELDS
  once = sharding.logical_sharding(mesh, ("batch",))
  out = {**{k: rows for k in fields}, "images": once}
  if prefixed:
    out.update({k: once for k in (*prefix.PROMPT_FIELDS, prefix.PROMPT_IMAGE_FIELD)})
  return out


def batch_shards(mesh: jax.sharding.Mesh) -> int:
  """How many ways the batch axes split rows and images."""
  return math.prod(mesh.shape[a] for a in sharding.BATCH_AXES)


def prepare_batch(
  batch: dict[str, np.ndarray],
  micro_batches: int,
  *,
  num_images: int = 0,
  shards: int = 1,
  row_images: bool = False,
) -> dict[str, np.ndarray]:
  """Host side: rows split into micro-batches; images padded with blanks to a static count.

  Args:
    batch: ``make_batch`` arrays plus ``image_index`` ``[rows]`` and ``images`` ``[U, ...]``
      (this consumer's images: in a consumer's share of a mini-batch, ``image_index`` points into
      the global array of every consumer's ``U`` images in consumer order).
    micro_batches: K.
    num_images: pad the images to at least this many (keeps the compiled shape fixed while the
      number of unique images varies); 0: no minimum.
    shards: the image count is rounded up to a multiple of this (the mesh's batch shards).
    row_images: the naive step's layout: one image per row (a row without one takes any image;
      the model reads no features for it), micro-batch ``k``'s row ``j`` at ``j * K + k`` so that
      each data-parallel shard holds its own rows' images; ``num_images`` and ``shards`` then
      do not apply.
  """
  if row_images:
    return _row_image_batch(batch, micro_batches)
  images = batch["images"]
  u = images.shape[0]
  target = max(u, num_images, 1)
  target = -(-target // shards) * shards
  if target > u:
    blank = np.zeros((target - u, *images.shape[1:]), images.dtype)
    images = np.concatenate([images, blank])
  rows = split_micro_batches({k: v for k, v in batch.items() if k != "images"}, micro_batches)
  return {**rows, "images": images}


def _row_image_batch(batch: dict[str, np.ndarray], micro_batches: int) -> dict[str, np.ndarray]:
  """`prepare_batch`'s ``row_images`` layout."""
  images, index = batch["images"], np.asarray(batch["image_index"])
  if not len(images):
    images = np.zeros((1, *images.shape[1:]), images.dtype)
  local = np.where(index >= 0, index % len(images), 0)  # a consumer's images: its own block
  fields = split_micro_batches({k: v for k, v in batch.items() if k != "images"}, micro_batches)
  rows = len(index)
  per_row = images[local].reshape(micro_batches, rows // micro_batches, *images.shape[1:])
  return {**fields, "images": per_row.swapaxes(0, 1).reshape(rows, *images.shape[1:])}


def compile_mm_train_step(
  *,
  graphdef: nnx.GraphDef,
  optimizer: optax.GradientTransformation,
  hparams: StepHParams,
  state_shardings: TrainState,
  mesh: jax.sharding.Mesh,
  encoder_dedup: bool = True,
  remat_encoder: bool = False,
  with_ref: bool = False,
  shared: bool = False,
  prefixed: bool = False,
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
  """``jax.jit`` of :func:`mm_train_step` with explicit shardings and the state donated
  (``shared``: the batch holds shared-prompt sequences, ``MM_SHARED_FIELDS``; ``prefixed``: rows
  that continue their prompts, ``MM_PREFIX_FIELDS``)."""
  fn = functools.partial(
    mm_train_step,
    graphdef=graphdef,
    optimizer=optimizer,
    hparams=hparams,
    encoder_dedup=encoder_dedup,
    remat_encoder=remat_encoder,
  )
  return jit_step(
    fn,
    state_shardings,
    batch_shardings(mesh, shared=shared, prefixed=prefixed),
    mesh,
    with_ref=with_ref,
  )
