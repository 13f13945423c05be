"""SigLIP-style vision encoder and the MLP projector into the language model, in Flax NNX.

The encoder follows SigLIP (Zhai et al., 2023): non-overlapping patches linearly embedded (a
convolution with stride = kernel = patch, written as a reshape and a matmul), a learned position
embedding, pre-LayerNorm transformer blocks with bidirectional multi-head attention and a GELU MLP,
no class token, and a final LayerNorm. Its output is one feature per patch; the projector (two
linear layers with a GELU between, as in LLaVA-1.5) maps each to the language model's width.

The defaults are knitjax's own small encoder. The options a Hugging Face SigLIP / LLaVA checkpoint
needs (`knitjax.models.hf_vision`) are: the MLP and projector GELUs exact or tanh-approximated,
image sizes that are not a multiple of the patch (the convolution drops the remainder), LLaVA's
feature layer(s) and select strategy, and SigLIP's attention-pooling head.

Params are float32 with logical axis names (see `knitjax.sharding`): the model width is "embed"
(FSDP), attention heads are "heads" and the MLP hidden units "mlp" (tensor parallel); pixel and
position dimensions and d_model-sized biases are replicated. Compute runs in `dtype`; norms and the
attention softmax stay in float32.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from knitjax.models import dtypes, layers

# Upper bounds on the encoder's shape, far above any released one (SigLIP-so400m: 27 layers, width
# 1152, 384-pixel images): what is larger would take minutes or all memory before a check spoke.
MAX_DIMS = {"image_size": 1 << 14, "channels": 16, "num_layers": 1024, "num_heads": 1 << 12}
MAX_WIDTH = 1 << 17  # d_model, head_dim, mlp_dim, projector_dim, patch_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
  """Shape of the vision encoder and projector. `projector_dim` is the projector's hidden width.

  `mlp_act` / `projector_act`: "gelu_tanh" (tanh approximation, HF `gelu_pytorch_tanh`) or "gelu"
  (exact erf). `feature_layers`: empty = the last block's output after the final LayerNorm;
  otherwise the hidden states the projector reads, concatenated on the feature axis, without the
  final LayerNorm, indexed as Hugging Face's `hidden_states` (0 = the patch embeddings, i = after
  block i, negative from the end of those num_layers + 1), i.e. LLaVA's `vision_feature_layer`.
  `drop_first_token`: LLaVA's "default" select strategy (drops the first patch; SigLIP has no
  class token, but LLaVA drops it all the same). `pool_head`: SigLIP's attention-pooling head
  (params and `VisionEncoder.pooled`; the VLM does not use it).
  """

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
  mlp_act: str = "gelu_tanh"
  projector_act: str = "gelu_tanh"
  feature_layers: tuple[int, ...] = ()
  drop_first_token: bool = False
  pool_head: bool = False
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
      most = MAX_DIMS.get(name, MAX_WIDTH)
      if value > most:
        raise ValueError(f"VisionConfig.{name}={value:,} is not accepted; at most {most:,}.")
    if self.image_size < self.patch_size:
      raise ValueError(
        f"VisionConfig.patch_size ({self.patch_size}) must be at most image_size "
        f"({self.image_size})."
      )
    for name in ("mlp_act", "projector_act"):
      if getattr(self, name) not in ACTIVATIONS:
        raise ValueError(
          f"VisionConfig.{name} must be one of {sorted(ACTIVATIONS)}, got {getattr(self, name)!r}."
        )
    n = self.num_layers
    layers_ok = isinstance(self.feature_layers, tuple) and all(
      isinstance(i, int) and not isinstance(i, bool) and -n - 1 <= i <= n
      for i in self.feature_layers
    )
    if not layers_ok:
      raise ValueError(
        f"VisionConfig.feature_layers must be a tuple of hidden-state indices in [{-n - 1}, {n}], "
        f"got {self.feature_layers!r}."
      )
    for name in ("drop_first_token", "pool_head"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"VisionConfig.{name} must be true or false, got {getattr(self, name)!r}.")
    if self.num_image_tokens < 1:
      raise ValueError(
        f"VisionConfig.drop_first_token=True leaves no image token of {self.num_patches} patch."
      )
    if self.dtype == dtypes.AUTO_DTYPE:
      object.__setattr__(self, "dtype", dtypes.resolve_dtype(self.dtype))
    if self.dtype not in dtypes.DTYPES:
      raise ValueError(
        f"VisionConfig.dtype must be one of {sorted(dtypes.DTYPES)} or 'auto', got {self.dtype!r}."
      )
    if not self.norm_eps > 0:
      raise ValueError(f"VisionConfig.norm_eps must be > 0, got {self.norm_eps!r}.")

  @property
  def num_patches(self) -> int:
    """Patches per image: the number of image placeholder tokens a prompt holds."""
    return (self.image_size // self.patch_size) ** 2

  @property
  def num_image_tokens(self) -> int:
    """Features per image the projector emits: placeholder tokens per image in a prompt."""
    return self.num_patches - int(self.drop_first_token)

  @property
  def feature_dim(self) -> int:
    """Width of the features the projector reads (d_model per selected hidden state)."""
    return self.d_model * max(1, len(self.feature_layers))

  @property
  def compute_dtype(self) -> jnp.dtype:
    return dtypes.DTYPES[self.dtype]


ACTIVATIONS = {
  "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
  "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


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

  def __call__(self, x_bpd: jax.Array, context_bqd: jax.Array | None = None) -> jax.Array:
    """Self-attention over `x_bpd`, or its queries attending to `context_bqd` when given."""
    dt = self.dtype
    context_bqd = x_bpd if context_bqd is None else context_bqd

    def project(x, kernel, bias):
      return jnp.einsum("bpd,dnh->bpnh", x, kernel[...].astype(dt)) + bias[...].astype(dt)

    q = project(x_bpd, self.q_kernel, self.q_bias)
    k = project(context_bqd, self.k_kernel, self.k_bias)
    v = project(context_bqd, self.v_kernel, self.v_bias)
    scores = jnp.einsum("bpnh,bqnh->bnpq", q, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(scores * self.head_dim**-0.5, axis=-1).astype(dt)
    out = jnp.einsum("bnpq,bqnh->bpnh", probs, v)
    return jnp.einsum("bpnh,nhd->bpd", out, self.o_kernel[...].astype(dt)) + self.o_bias[
      ...
    ].astype(dt)


class EncoderBlock(nnx.Module):
  """Pre-norm ViT block: x + attn(ln(x)), then x + mlp(ln(x)) with a GELU MLP."""

  def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs):
    dt = config.compute_dtype
    self.act = config.mlp_act  # a name: graphdefs stay picklable
    self.attn_norm = LayerNorm(config.d_model, eps=config.norm_eps, rngs=rngs)
    self.attn = SelfAttention(config, rngs=rngs)
    self.mlp_norm = LayerNorm(config.d_model, eps=config.norm_eps, rngs=rngs)
    self.fc1 = Dense(config.d_model, config.mlp_dim, ("embed", "mlp"), dtype=dt, rngs=rngs)
    self.fc2 = Dense(config.mlp_dim, config.d_model, ("mlp", None), dtype=dt, rngs=rngs)

  def __call__(self, x_bpd: jax.Array) -> jax.Array:
    x_bpd = x_bpd + self.attn(self.attn_norm(x_bpd))
    return x_bpd + self.fc2(ACTIVATIONS[self.act](self.fc1(self.mlp_norm(x_bpd))))


class PoolingHead(nnx.Module):
  """SigLIP's attention pooling: a learned probe attends to the patches, then x + mlp(ln(x))."""

  def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs):
    dt = config.compute_dtype
    self.act = config.mlp_act  # a name: graphdefs stay picklable
    self.probe = layers.param(
      rngs, _normal(config.d_model**-0.5), (1, config.d_model), (None, "embed")
    )
    self.attn = SelfAttention(config, rngs=rngs)
    self.norm = LayerNorm(config.d_model, eps=config.norm_eps, rngs=rngs)
    self.fc1 = Dense(config.d_model, config.mlp_dim, ("embed", "mlp"), dtype=dt, rngs=rngs)
    self.fc2 = Dense(config.mlp_dim, config.d_model, ("mlp", None), dtype=dt, rngs=rngs)

  def __call__(self, x_bpd: jax.Array) -> jax.Array:
    """[N, P, D] -> [N, D]."""
    probe = jnp.broadcast_to(
      self.probe[...].astype(x_bpd.dtype), (x_bpd.shape[0], 1, x_bpd.shape[2])
    )
    x = self.attn(probe, x_bpd)
    return (x + self.fc2(ACTIVATIONS[self.act](self.fc1(self.norm(x)))))[:, 0]


def patchify(images_nhwc: jax.Array, patch_size: int) -> jax.Array:
  """[N, H, W, C] -> [N, (H/p)(W/p), p*p*C], patches in row-major order.

  Sizes that are not a multiple of p lose their last rows / columns, as a stride-p convolution.
  """
  n, h, w, c = images_nhwc.shape
  p = patch_size
  if h % p or w % p:
    images_nhwc = images_nhwc[:, : h - h % p, : w - w % p]
    h, w = h - h % p, w - w % p
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
    self.head = PoolingHead(config, rngs=rngs) if config.pool_head else None

  def _embed(self, images_nhwc: jax.Array) -> jax.Array:
    c = self.config
    want = (c.image_size, c.image_size, c.channels)
    if images_nhwc.ndim != 4 or tuple(images_nhwc.shape[1:]) != want:
      raise ValueError(f"images must be [N, {', '.join(map(str, want))}], got {images_nhwc.shape}.")
    x = images_nhwc.astype(jnp.float32) / 127.5 - 1.0
    x = self.patch_embed(patchify(x, c.patch_size))
    return x + self.pos_embed[...].astype(x.dtype)

  def last_hidden_state(self, images_nhwc: jax.Array) -> jax.Array:
    """Every block, then the final LayerNorm: [N, num_patches, d_model] (SigLIP's output)."""
    x = self._embed(images_nhwc)
    for block in self.blocks:
      x = block(x)
    return self.final_norm(x)

  def pooled(self, images_nhwc: jax.Array) -> jax.Array:
    """The attention-pooling head on `last_hidden_state`: [N, d_model] (SigLIP's pooler_output)."""
    if self.head is None:
      raise ValueError("VisionEncoder.pooled needs a VisionConfig with pool_head=True.")
    return self.head(self.last_hidden_state(images_nhwc))

  def __call__(self, images_nhwc: jax.Array) -> jax.Array:
    """Features the projector reads, [N, num_image_tokens, feature_dim], of uint8 images (or
    floats in [0, 255]) [N, H, W, C], scaled to [-1, 1] as SigLIP's processor does."""
    c = self.config
    if not c.feature_layers:
      x = self.last_hidden_state(images_nhwc)
    else:
      # Hugging Face's hidden_states: [embeddings, after block 1, ..., after block L].
      picked = [i % (c.num_layers + 1) for i in c.feature_layers]
      hidden = [self._embed(images_nhwc)]
      for block in self.blocks[: max(picked)]:
        hidden.append(block(hidden[-1]))
      x = jnp.concatenate([hidden[i] for i in picked], axis=-1)
    return x[:, 1:] if c.drop_first_token else x


class Projector(nnx.Module):
  """Two-layer GELU MLP from the encoder width to the language model width (LLaVA-1.5)."""

  def __init__(
    self,
    d_in: int,
    hidden: int,
    d_out: int,
    *,
    dtype: jnp.dtype,
    rngs: nnx.Rngs,
    act: str = "gelu_tanh",
  ):
    self.act = act
    self.fc1 = Dense(d_in, hidden, ("embed", "mlp"), dtype=dtype, rngs=rngs)
    self.fc2 = Dense(hidden, d_out, ("mlp", "embed"), dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(ACTIVATIONS[self.act](self.fc1(x)))
