"""SigLIP-style vision encoder and the MLP projector into the language model, in Flax NNX.

The encoder follows SigLIP (Zhai et al., 2023): non-overlapping patches linearly embedded (a
convolution with stride = kernel = patch, written as a reshape and a matmul), a learned position
embedding, pre-LayerNorm transformer blocks with bidirectional multi-head attention and a GELU MLP,
no class token, and a final LayerNorm. Its output is one feature per patch; the projector (two
linear layers with a GELU between, as in LLaVA-1.5) maps each to the language model's width.

Params are float32 with logical axis names (see `knitjax.sharding`): the model width is "embed"
(FSDP), attention heads are "heads" and the MLP hidden units "mlp" (tensor parallel); pixel and
position dimensions and d_model-sized biases are replicated. Compute runs in `dtype`; norms and the
attention softmax stay in float32.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from knitjax.models import layers


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
  """Shape of the vision encoder and projector. `projector_dim` is the projector's hidden width."""

  image_size: int = 16
  patch_size: int = 4
  channels: int = 3
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  head_dim: int = 16
  mlp_dim: int = 128
  projector_dim: int = 128
  norm_eps: float = 1e-6
  dtype: str = "float32"

  def __post_init__(self):
    for name in (
      "image_size",
      "patch_size",
      "channels",
      "d_model",
      "num_layers",
      "num_heads",
      "head_dim",
      "mlp_dim",
      "projector_dim",
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"VisionConfig.{name} must be a positive integer, got {value!r}.")
    if self.image_size % self.patch_size:
      raise ValueError(
        f"VisionConfig.image_size ({self.image_size}) must be a multiple of patch_size "
        f"({self.patch_size})."
      )
    if self.dtype not in layers.DTYPES:
      raise ValueError(
        f"VisionConfig.dtype must be one of {sorted(layers.DTYPES)}, got {self.dtype!r}."
      )
    if not self.norm_eps > 0:
      raise ValueError(f"VisionConfig.norm_eps must be > 0, got {self.norm_eps!r}.")

  @property
  def num_patches(self) -> int:
    """Patches per image: the number of image placeholder tokens a prompt holds."""
    return (self.image_size // self.patch_size) ** 2

  @property
  def compute_dtype(self) -> jnp.dtype:
    return layers.DTYPES[self.dtype]


def _normal(stddev: float):
  return jax.nn.initializers.normal(stddev=stddev)


class LayerNorm(nnx.Module):
  """LayerNorm with scale and bias, computed in float32."""

  def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs):
    self.eps = eps
    self.scale = layers.param(rngs, jax.nn.initializers.ones, (dim,), ("norm",))
    self.bias = layers.param(rngs, jax.nn.initializers.zeros, (dim,), ("norm",))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


class Dense(nnx.Module):
  """x @ kernel + bias, with logical axes `(in_axis, out_axis)` on the kernel."""

  def __init__(
    self,
    d_in: int,
    d_out: int,
    axes: tuple[str | None, str | None],
    *,
    dtype: jnp.dtype,
    rngs: nnx.Rngs,
  ):
    self.dtype = dtype
    self.kernel = layers.param(rngs, _normal(d_in**-0.5), (d_in, d_out), axes)
    self.bias = layers.param(rngs, jax.nn.initializers.zeros, (d_out,), (axes[1],))

  def __call__(self, x: jax.Array) -> jax.Array:
    return x.astype(self.dtype) @ self.kernel[...].astype(self.dtype) + self.bias[...].astype(
      self.dtype
    )


class SelfAttention(nnx.Module):
  """Bidirectional multi-head attention with q/k/v/out biases (no RoPE: positions are learned)."""

  def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs):
    d, n, h = config.d_model, config.num_heads, config.head_dim
    self.dtype = config.compute_dtype
    self.head_dim = h
    zeros = jax.nn.initializers.zeros
    qkv_axes = ("embed", "heads", "head_dim")
    self.q_kernel = layers.param(rngs, _normal(d**-0.5), (d, n, h), qkv_axes)
    self.k_kernel = layers.param(rngs, _normal(d**-0.5), (d, n, h), qkv_axes)
    self.v_kernel = layers.param(rngs, _normal(d**-0.5), (d, n, h), qkv_axes)
    self.q_bias = layers.param(rngs, zeros, (n, h), ("heads", "head_dim"))
    self.k_bias = layers.param(rngs, zeros, (n, h), ("heads", "head_dim"))
    self.v_bias = layers.param(rngs, zeros, (n, h), ("heads", "head_dim"))
    self.o_kernel = layers.param(
      rngs, _normal((n * h) ** -0.5), (n, h, d), ("heads", "head_dim", "embed")
    )
    self.o_bias = layers.param(rngs, zeros, (d,), (None,))

  def __call__(self, x_bpd: jax.Array) -> jax.Array:
    dt = self.dtype

    def project(kernel, bias):
      return jnp.einsum("bpd,dnh->bpnh", x_bpd, kernel[...].astype(dt)) + bias[...].astype(dt)

    q = project(self.q_kernel, self.q_bias)
    k = project(self.k_kernel, self.k_bias)
    v = project(self.v_kernel, self.v_bias)
    scores = jnp.einsum("bpnh,bqnh->bnpq", q, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(scores * self.head_dim**-0.5, axis=-1).astype(dt)
    out = jnp.einsum("bnpq,bqnh->bpnh", probs, v)
    return jnp.einsum("bpnh,nhd->bpd", out, self.o_kernel[...].astype(dt)) + self.o_bias[
      ...
    ].astype(dt)


class EncoderBlock(nnx.Module):
  """Pre-norm ViT block: x + attn(ln(x)), then x + mlp(ln(x)) with a tanh-GELU MLP."""

  def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs):
    dt = config.compute_dtype
    self.attn_norm = LayerNorm(config.d_model, eps=config.norm_eps, rngs=rngs)
    self.attn = SelfAttention(config, rngs=rngs)
    self.mlp_norm = LayerNorm(config.d_model, eps=config.norm_eps, rngs=rngs)
    self.fc1 = Dense(config.d_model, config.mlp_dim, ("embed", "mlp"), dtype=dt, rngs=rngs)
    self.fc2 = Dense(config.mlp_dim, config.d_model, ("mlp", None), dtype=dt, rngs=rngs)

  def __call__(self, x_bpd: jax.Array) -> jax.Array:
    x_bpd = x_bpd + self.attn(self.attn_norm(x_bpd))
    return x_bpd + self.fc2(jax.nn.gelu(self.fc1(self.mlp_norm(x_bpd)), approximate=True))


def patchify(images_nhwc: jax.Array, patch_size: int) -> jax.Array:
  """[N, H, W, C] -> [N, (H/p)(W/p), p*p*C], patches in row-major order."""
  n, h, w, c = images_nhwc.shape
  p = patch_size
  x = images_nhwc.reshape(n, h // p, p, w // p, p, c)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(n, (h // p) * (w // p), p * p * c)


class VisionEncoder(nnx.Module):
  """SigLIP-style ViT: images -> one feature per patch, [N, num_patches, d_model]."""

  def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs):
    self.config = config
    dt = config.compute_dtype
    patch_dim = config.patch_size**2 * config.channels
    self.patch_embed = Dense(patch_dim, config.d_model, (None, "embed"), dtype=dt, rngs=rngs)
    self.pos_embed = layers.param(
      rngs, _normal(config.d_model**-0.5), (config.num_patches, config.d_model), (None, "embed")
    )
    self.blocks = nnx.List([EncoderBlock(config, rngs=rngs) for _ in range(config.num_layers)])
    self.final_norm = LayerNorm(config.d_model, eps=config.norm_eps, rngs=rngs)

  def __call__(self, images_nhwc: jax.Array) -> jax.Array:
    """Encodes uint8 images (or floats in [0, 255]) [N, H, W, C]; SigLIP's [-1, 1] scaling."""
    c = self.config
    want = (c.image_size, c.image_size, c.channels)
    if images_nhwc.ndim != 4 or tuple(images_nhwc.shape[1:]) != want:
      raise ValueError(f"images must be [N, {', '.join(map(str, want))}], got {images_nhwc.shape}.")
    x = images_nhwc.astype(jnp.float32) / 127.5 - 1.0
    x = self.patch_embed(patchify(x, c.patch_size))
    x = x + self.pos_embed[...].astype(x.dtype)
    for block in self.blocks:
      x = block(x)
    return self.final_norm(x)


class Projector(nnx.Module):
  """Two-layer GELU MLP from the encoder width to the language model width (LLaVA-1.5)."""

  def __init__(self, d_in: int, hidden: int, d_out: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
    self.fc1 = Dense(d_in, hidden, ("embed", "mlp"), dtype=dtype, rngs=rngs)
    self.fc2 = Dense(hidden, d_out, ("mlp", "embed"), dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))


def encoder_flops(config: VisionConfig, d_out: int) -> float:
  """Forward FLOPs of encoder + projector for one image (2 per multiply-add; for cost notes)."""
  p, d = config.num_patches, config.d_model
  attn = config.num_heads * config.head_dim
  per_block = 2 * p * d * attn * 4 + 2 * 2 * p * p * attn + 2 * 2 * p * d * config.mlp_dim
  patch = 2 * p * config.patch_size**2 * config.channels * d
  proj = 2 * p * (d * config.projector_dim + config.projector_dim * d_out)
  return float(patch + config.num_layers * per_block + proj)
