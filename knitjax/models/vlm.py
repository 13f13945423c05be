"""VLM wiring: vision encoder + projector + decoder, image placeholders replaced by patch features.

A multimodal prompt holds `vision_config.num_image_tokens` placeholder tokens (`image_token_id`)
per image (one per patch, less the first with LLaVA's "default" strategy). The k-th placeholder of
a row takes the k-th projected feature of that row's image, as LLaVA's `masked_scatter` does;
every other position keeps its token embedding. The decoder then runs on these embeddings
unchanged (`Transformer.__call__` / `prefill` take `embeddings_btd`), so decoding is the text
path: only the prefill sees the image.

Params split into the encoder side (`vision`, `projector`) and the backbone (`lm`); the train step
differentiates them separately (see `knitjax.train.dedup`).
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from knitjax import sharding
from knitjax.models.attention import PLAIN, SequenceMask
from knitjax.models.transformer import KVCache, Transformer, TransformerConfig
from knitjax.models.vision import Projector, VisionConfig, VisionEncoder

ENCODER_PARTS = ("vision", "projector")
BACKBONE_PARTS = ("lm",)


def splice_image_rows(
  x_btd: jax.Array, tokens_bt: jax.Array, rows_bpd: jax.Array, image_token_id: int
) -> jax.Array:
  """Replaces the k-th placeholder of each row by `rows_bpd[row, k]`; other positions unchanged.

  Rows must hold at most P placeholders (extra ones would repeat the last patch); rows without
  any keep their token embeddings whatever `rows_bpd` holds, and get no gradient into it.
  """
  is_image_bt = tokens_bt == image_token_id
  slot_bt = jnp.clip(jnp.cumsum(is_image_bt, axis=1) - 1, 0, rows_bpd.shape[1] - 1)
  picked_btd = jnp.take_along_axis(rows_bpd, slot_bt[..., None], axis=1)
  return jnp.where(is_image_bt[..., None], picked_btd.astype(x_btd.dtype), x_btd)


def split_params(params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(encoder-side params: vision and projector, backbone params: lm) of a VLM's state."""
  return (
    nnx.State({k: params[k] for k in ENCODER_PARTS}),
    nnx.State({k: params[k] for k in BACKBONE_PARTS}),
  )


class VLM(nnx.Module):
  """Decoder LM that reads images through a SigLIP-style encoder and an MLP projector."""

  def __init__(
    self,
    lm_config: TransformerConfig,
    vision_config: VisionConfig,
    *,
    image_token_id: int,
    rngs: nnx.Rngs,
  ):
    if not 0 <= image_token_id < lm_config.vocab_size:
      raise ValueError(
        f"VLM image_token_id={image_token_id} must be a token id in [0, {lm_config.vocab_size})."
      )
    self.image_token_id = image_token_id
    self.config = lm_config
    self.vision_config = vision_config
    self.vision = VisionEncoder(vision_config, rngs=rngs)
    self.projector = Projector(
      vision_config.feature_dim,
      vision_config.projector_dim,
      lm_config.d_model,
      dtype=vision_config.compute_dtype,
      rngs=rngs,
      act=vision_config.projector_act,
    )
    self.lm = Transformer(lm_config, rngs=rngs)

  def encode_images(self, images_nhwc: jax.Array) -> jax.Array:
    """Projected features [N, num_image_tokens, lm d_model] of uint8 images [N, H, W, C]."""
    return self.projector(self.vision(images_nhwc))

  def embed(self, tokens_bt: jax.Array, image_rows_bpd: jax.Array | None = None) -> jax.Array:
    """Token embeddings with each row's placeholders replaced by its image's patch features."""
    x = self.lm.embed(tokens_bt)
    if image_rows_bpd is None:
      return x
    return splice_image_rows(x, tokens_bt, image_rows_bpd, self.image_token_id)

  def prompt_embeddings(
    self, tokens_bt: jax.Array, images_unhwc: jax.Array, image_index_b: jax.Array
  ) -> jax.Array:
    """Embeddings of image prompts; each of the U unique images is encoded once.

    Args:
      tokens_bt: prompt tokens with placeholders.
      images_unhwc: the unique images of the batch.
      image_index_b: row -> index into `images_unhwc`; -1 for a row without image.
    """
    feats_upd = self.encode_images(images_unhwc)
    rows_bpd = jnp.take(feats_upd, jnp.maximum(image_index_b, 0), axis=0)
    return self.embed(tokens_bt, rows_bpd)

  def __call__(
    self,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    valid_bt: jax.Array,
    *,
    image_rows_bpd: jax.Array | None = None,
    images_bhwc: jax.Array | None = None,
  ) -> jax.Array:
    """Full-sequence forward, float32 logits [B, T, V].

    Give each row's image (`images_bhwc`, encoded here) or its already projected features
    (`image_rows_bpd`); with neither, this is the text-only decoder.
    """
    if images_bhwc is not None:
      if image_rows_bpd is not None:
        raise ValueError("give images_bhwc or image_rows_bpd, not both.")
      image_rows_bpd = self.encode_images(images_bhwc)
    x = self.embed(tokens_bt, image_rows_bpd)
    return self.lm(tokens_bt, positions_bt, valid_bt, embeddings_btd=x)

  def hidden_states(
    self,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    valid_bt: jax.Array,
    *,
    image_rows_bpd: jax.Array | None = None,
    mask: SequenceMask = PLAIN,
  ) -> jax.Array:
    """The decoder's final-normed hidden states [B, T, D] (`__call__` without the logits);
    ``mask`` as in `Transformer.__call__` (packed rows, the shared-prompt tree mask)."""
    x = self.embed(tokens_bt, image_rows_bpd)
    return self.lm.hidden_states(tokens_bt, positions_bt, valid_bt, embeddings_btd=x, mask=mask)

  def keys_values(
    self,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    valid_bt: jax.Array,
    *,
    image_rows_bpd: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """The decoder's keys and values of every layer (`Transformer.keys_values`) of prompts with
    their images' features spliced in."""
    x = self.embed(tokens_bt, image_rows_bpd)
    return self.lm.keys_values(tokens_bt, positions_bt, valid_bt, embeddings_btd=x)

  def unembedding(self) -> tuple[jax.Array, str]:
    """The decoder's output projection and its axes (`Transformer.unembedding`)."""
    return self.lm.unembedding()

  # The sampler's interface (text path of the decoder; images enter through `embeddings_btd`).
  def init_cache(self, batch: int, max_len: int) -> KVCache:
    return self.lm.init_cache(batch, max_len)

  def prefill(
    self,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    valid_bt: jax.Array,
    cache: KVCache,
    *,
    embeddings_btd: jax.Array | None = None,
  ) -> tuple[jax.Array, KVCache]:
    return self.lm.prefill(tokens_bt, positions_bt, valid_bt, cache, embeddings_btd=embeddings_btd)

  def decode_step(
    self, tokens_b: jax.Array, positions_b: jax.Array, cache: KVCache
  ) -> tuple[jax.Array, KVCache]:
    return self.lm.decode_step(tokens_b, positions_b, cache)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _prompt_embeddings(params, tokens_bp, images_unhwc, image_index_b, *, graphdef):
  return nnx.merge(graphdef, params).prompt_embeddings(tokens_bp, images_unhwc, image_index_b)


def make_prompt_embedder(
  graphdef: nnx.GraphDef, mesh: jax.sharding.Mesh
) -> Callable[[nnx.State, np.ndarray, np.ndarray, np.ndarray], jax.Array]:
  """Rollout side: `(params, tokens_bp, images_unhwc, image_index_b) -> embeddings [B, P, D]`.

  Each unique image of the rollout batch is encoded once; the result is split over the mesh's
  batch axes, ready for `Sampler(..., embeddings=...)`.
  """
  rows = functools.partial(sharding.batch_sharding, mesh)

  def embed(params, tokens_bp, images_unhwc, image_index_b):
    with jax.set_mesh(mesh):
      out = _prompt_embeddings(
        params,
        jax.device_put(np.asarray(tokens_bp, np.int32), rows(2)),
        jax.device_put(np.asarray(images_unhwc), sharding.replicated(mesh)),
        jax.device_put(np.asarray(image_index_b, np.int32), rows(1)),
        graphdef=graphdef,
      )
      return jax.device_put(out, rows(3))

  return embed
