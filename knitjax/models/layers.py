"""Building blocks of the decoder: RMSNorm, RoPE, embedding, grouped-query attention, SwiGLU MLP.

Every parameter is float32 and carries its logical axis names as `out_sharding` metadata
(`knitjax.sharding` maps them onto the mesh). Computation runs in a configurable `dtype`: params
are cast at use, while norms, RoPE, attention softmax and the output logits stay in float32.
RoPE may carry the frequency scaling of long-context checkpoints (`RopeScaling`). Given a
`LoraSpec`, the targeted projections carry low-rank adapters (`knitjax.models.lora`).
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from knitjax.models import attention as attention_lib
from knitjax.models import lora as lora_lib
from knitjax.models.keys import params_key


def param(
  rngs: nnx.Rngs, init: Callable, shape: tuple[int, ...], axes: tuple[str | None, ...]
) -> nnx.Param:
  """A float32 parameter annotated with logical axes (no eager sharding: placement is explicit)."""
  if len(shape) != len(axes):
    raise ValueError(f"shape {shape} and logical axes {axes} must have the same length.")
  value = init(params_key(rngs), shape, jnp.float32)
  return nnx.Param(value, eager_sharding=False, out_sharding=axes)


def _normal(stddev: float) -> Callable:
  return jax.nn.initializers.normal(stddev=stddev)


class RMSNorm(nnx.Module):
  """RMSNorm with a learned scale (initialised to 1), computed in float32."""

  def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs):
    self.eps = eps
    self.scale = param(rngs, jax.nn.initializers.ones, (dim,), ("norm",))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return (x32 * self.scale[...]).astype(x.dtype)


# RoPE scaling types `RopeScaling` implements, each with the fields it reads besides `factor`.
ROPE_SCALING_FIELDS = {
  "linear": (),
  "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
  "yarn": (
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "truncate",
  ),
}
_OPTIONAL_FIELDS = ("beta_fast", "beta_slow", "attention_factor", "truncate")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's attention temperature 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _finite_positive(value) -> bool:
  return not isinstance(value, bool) and isinstance(value, int | float) and 0 < value < math.inf


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """RoPE frequency scaling, as transformers' `modeling_rope_utils` computes it.

  `linear` divides every frequency by `factor`. `llama3` (Llama-3.1+) divides the frequencies
  whose wavelength exceeds `original_max_position_embeddings / low_freq_factor` by `factor`, keeps
  those shorter than `original_max_position_embeddings / high_freq_factor`, and blends between.
  `yarn` (e.g. Qwen2.5 long context) blends `1/factor`-interpolated and original frequencies over
  the dimensions between the `beta_fast` (default 32) and `beta_slow` (default 1) rotation counts
  (bounds rounded outwards unless `truncate` is False), and multiplies cos and sin by
  `attention_factor` (default `yarn_mscale(factor)`). Fields a type does not read stay None.
  """

  rope_type: str  # one of ROPE_SCALING_FIELDS
  factor: float
  original_max_position_embeddings: int | None = None
  low_freq_factor: float | None = None
  high_freq_factor: float | None = None
  beta_fast: float | None = None
  beta_slow: float | None = None
  attention_factor: float | None = None
  truncate: bool | None = None

  def __post_init__(self):
    if self.rope_type not in ROPE_SCALING_FIELDS:
      raise ValueError(
        f"RopeScaling.rope_type must be one of {sorted(ROPE_SCALING_FIELDS)}, "
        f"got {self.rope_type!r}."
      )
    used = ROPE_SCALING_FIELDS[self.rope_type]
    for field in dataclasses.fields(self):
      name, value = field.name, getattr(self, field.name)
      if name in ("rope_type", "factor"):
        continue
      if name not in used:
        if value is not None:
          raise ValueError(
            f"RopeScaling.{name} is not used by rope_type {self.rope_type!r}; leave it None."
          )
      elif name == "truncate":
        if value is not None and not isinstance(value, bool):
          raise ValueError(f"RopeScaling.truncate must be true, false or None, got {value!r}.")
      elif name == "original_max_position_embeddings":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
          raise ValueError(
            f"RopeScaling.{name} must be a positive integer for {self.rope_type!r}, got {value!r}."
          )
      elif not (_finite_positive(value) or (value is None and name in _OPTIONAL_FIELDS)):
        raise ValueError(
          f"RopeScaling.{name} must be a finite number > 0 for {self.rope_type!r}, got {value!r}."
        )
    if not _finite_positive(self.factor):
      raise ValueError(f"RopeScaling.factor must be a finite number > 0, got {self.factor!r}.")
    if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(
        f"RopeScaling.high_freq_factor ({self.high_freq_factor}) must be greater than "
        f"low_freq_factor ({self.low_freq_factor})."
      )

  @property
  def cos_sin_scale(self) -> float:
    """The factor cos and sin are multiplied by (transformers' `attention_scaling`)."""
    if self.rope_type != "yarn":
      return 1.0
    return yarn_mscale(self.factor) if self.attention_factor is None else self.attention_factor

  def inv_freq(self, head_dim: int, theta: float) -> np.ndarray:
    """The scaled inverse frequencies [head_dim/2], float32.

    Follows transformers' float32 torch arithmetic step for step (NumPy >= 2 keeps Python scalars
    weak, as torch does), so the frequencies agree to the last bit or two.
    """
    exponent = np.arange(0, head_dim, 2).astype(np.float32) / head_dim
    base = np.float32(theta) ** exponent  # torch: python base ** float32 tensor, in float32
    inv_freq = 1.0 / base
    factor = self.factor
    if self.rope_type == "linear":
      return inv_freq / factor
    if self.rope_type == "llama3":
      old_context = self.original_max_position_embeddings
      low_wavelen = old_context / self.low_freq_factor
      high_wavelen = old_context / self.high_freq_factor
      wavelen = 2 * math.pi / inv_freq
      scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
      smooth = (old_context / wavelen - self.low_freq_factor) / (
        self.high_freq_factor - self.low_freq_factor
      )
      smoothed = (1 - smooth) * scaled / factor + smooth * scaled
      medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
      return np.where(medium, smoothed, scaled).astype(np.float32)
    # yarn
    beta_fast, beta_slow = self.beta_fast or 32, self.beta_slow or 1

    def correction_dim(rotations):
      return (
        head_dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
      ) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if self.truncate is None or self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
      high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    interpolation = 1.0 / (factor * base)
    return (interpolation * (1 - extrapolation) + inv_freq * extrapolation).astype(np.float32)


def rope_sin_cos(
  positions_bt: jax.Array, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[jax.Array, ...]:
  """Sine and cosine tables [B, T, head_dim/2] (float32) for rotary embeddings.

  With `scaling`, its frequencies (a constant computed at trace time) and its cos/sin scale.
  """
  if scaling is None:
    fraction = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (theta**fraction)
  else:
    inv_freq = jnp.asarray(scaling.inv_freq(head_dim, theta))
  angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  if scaling is not None and scaling.cos_sin_scale != 1.0:
    scale = np.float32(scaling.cos_sin_scale)
    sin, cos = sin * scale, cos * scale
  return sin, cos


def apply_rope(x_btnh: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
  """Rotary embedding in the "rotate half" layout of Llama / Qwen checkpoints."""
  x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
  sin, cos = sin[:, :, None, :], cos[:, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_btnh.dtype)


class Embed(nnx.Module):
  """Token embedding; `attend` gives float32 logits with the same (tied) table."""

  def __init__(self, vocab_size: int, d_model: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
    self.dtype = dtype
    # 1/sqrt(d) keeps tied logits of a fresh model near unit scale (a diffuse initial policy).
    self.embedding = param(rngs, _normal(d_model**-0.5), (vocab_size, d_model), ("vocab", "embed"))

  def __call__(self, tokens_bt: jax.Array) -> jax.Array:
    return jnp.take(self.embedding[...], tokens_bt, axis=0).astype(self.dtype)

  def attend(self, x_btd: jax.Array) -> jax.Array:
    table = self.embedding[...].astype(self.dtype)
    return jnp.einsum("...d,vd->...v", x_btd, table, preferred_element_type=jnp.float32)


class ValueHead(nnx.Module):
  """The critic's head: one float32 value per position, ``V = x @ w + b``, from the final-normed
  hidden state the logits also read (a shared trunk, as in the value-head models of Ziegler et
  al., 2019). Zero-initialised, so a fresh critic predicts 0 and PPO starts from ``A = R``."""

  def __init__(self, d_model: int, *, rngs: nnx.Rngs):
    zeros = jax.nn.initializers.zeros
    self.kernel = param(rngs, zeros, (d_model,), ("embed",))
    self.bias = param(rngs, zeros, (), ())

  def __call__(self, x_btd: jax.Array) -> jax.Array:
    x = x_btd.astype(jnp.float32)
    return jnp.einsum("...d,d->...", x, self.kernel[...]) + self.bias[...]


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE, optional q/k RMSNorm and optional q/k/v bias."""

  def __init__(
    self,
    *,
    d_model: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rope_theta: float,
    norm_eps: float,
    qk_norm: bool,
    qkv_bias: bool,
    dtype: jnp.dtype,
    rngs: nnx.Rngs,
    attention: str = "auto",
  ):
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.rope_theta, self.dtype = rope_theta, dtype
    self.attention = attention  # implementation of `attention_lib.attend` (IMPLS)
    fan_in = _normal(d_model**-0.5)
    self.q_kernel = param(
      rngs, fan_in, (d_model, num_heads, head_dim), ("embed", "heads", "head_dim")
    )
    kv_shape, kv_axes = (d_model, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim")
    self.k_kernel = param(rngs, fan_in, kv_shape, kv_axes)
    self.v_kernel = param(rngs, fan_in, kv_shape, kv_axes)
    self.o_kernel = param(
      rngs,
      _normal((num_heads * head_dim) ** -0.5),
      (num_heads, head_dim, d_model),
      ("heads", "head_dim", "embed"),
    )
    if qkv_bias:
      zeros = jax.nn.initializers.zeros
      self.q_bias = param(rngs, zeros, (num_heads, head_dim), ("heads", "head_dim"))
      self.k_bias = param(rngs, zeros, (num_kv_heads, head_dim), ("kv_heads", "head_dim"))
      self.v_bias = param(rngs, zeros, (num_kv_heads, head_dim), ("kv_heads", "head_dim"))
    else:
      self.q_bias = self.k_bias = self.v_bias = None
    if qk_norm:
      self.q_norm = RMSNorm(head_dim, eps=norm_eps, rngs=rngs)
      self.k_norm = RMSNorm(head_dim, eps=norm_eps, rngs=rngs)
    else:
      self.q_norm = self.k_norm = None
    self.q_lora = self.k_lora = self.v_lora = self.o_lora = None

  def add_adapters(self, spec: lora_lib.LoraSpec, rngs: nnx.Rngs) -> None:
    """Puts LoRA adapters on the projections ``spec`` targets (q, k, v, o)."""
    for name, n_in in (("q", 1), ("k", 1), ("v", 1), ("o", 2)):
      kernel = getattr(self, f"{name}_kernel")
      adapter = lora_lib.adapter(name, spec, kernel, n_in, dtype=self.dtype, rngs=rngs)
      setattr(self, f"{name}_lora", nnx.data(adapter))

  def _project(self, x_btd: jax.Array, kernel: nnx.Param, bias: nnx.Param | None, adapter):
    out = jnp.einsum("btd,dnh->btnh", x_btd, kernel[...].astype(self.dtype))
    if adapter is not None:
      out = out + adapter(x_btd)
    if bias is not None:
      out = out + bias[...].astype(self.dtype)
    return out

  def __call__(
    self,
    x_btd: jax.Array,
    sin_cos: tuple[jax.Array, jax.Array],
    valid_bs: jax.Array,
    kv_cache: tuple[jax.Array, jax.Array] | None = None,
    cache_index: jax.Array | None = None,
    mask: attention_lib.SequenceMask = attention_lib.PLAIN,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Attends the T new positions to the earlier-or-equal valid keys (`attention_lib.attend`).

    Args:
      x_btd: normalised inputs of the new positions.
      sin_cos: RoPE tables of the new positions.
      valid_bs: bool key validity: [B, T] for a full sequence, [B, S] over the cache's positions
        (the new positions included) with `kv_cache`.
      kv_cache: (k, v) [B, S, K, H] of this layer; the new keys are written at `cache_index`.
      cache_index: scalar index of the first new position in the cache.
      mask: what a query of a full sequence sees beyond its causal, valid keys (packed rows,
        the shared-prompt tree mask, fixed spans: `attention_lib.SequenceMask`).

    Returns:
      The attention output [B, T, D] and the (updated) keys and values.
    """
    q = self._project(x_btd, self.q_kernel, self.q_bias, self.q_lora)
    k = self._project(x_btd, self.k_kernel, self.k_bias, self.k_lora)
    v = self._project(x_btd, self.v_kernel, self.v_bias, self.v_lora)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rope(q, *sin_cos), apply_rope(k, *sin_cos)
    q_offset = 0
    if kv_cache is not None:
      if not mask.plain:
        raise ValueError("a SequenceMask applies to a full sequence, not to a KV cache.")
      start = (0, cache_index, 0, 0)
      k = jax.lax.dynamic_update_slice(kv_cache[0], k.astype(kv_cache[0].dtype), start)
      v = jax.lax.dynamic_update_slice(kv_cache[1], v.astype(kv_cache[1].dtype), start)
      q_offset = cache_index
    if mask.past_k is not None:
      k, v, valid_bs, q_offset = _after_past(k, v, valid_bs, mask)
    if mask.spans is not None:
      out = attention_lib.attend_spans(
        q, k, v, kv_valid_bs=valid_bs, prompt_len=mask.spans[0], span_len=mask.spans[1],
        impl=self.attention,
      )  # fmt: skip
    else:
      out = attention_lib.attend(
        q, k, v, kv_valid_bs=valid_bs, q_offset=q_offset, q_segment_bt=mask.segment_ids_bt,
        kv_segment_bs=mask.segment_ids_bt, q_prefix_bt=mask.prefix_ids_bt, impl=self.attention,
      )  # fmt: skip
    proj = jnp.einsum("btnh,nhd->btd", out, self.o_kernel[...].astype(self.dtype))
    if self.o_lora is not None:
      proj = proj + self.o_lora(out)
    return proj, (k, v)


def _after_past(k, v, valid_bs, mask: attention_lib.SequenceMask):
  """The row's keys, values and key validity behind its past ones (`SequenceMask.past_k`), and
  its queries' slot offset: the row attends as if the past were its first columns."""
  if mask.segment_ids_bt is not None or mask.spans is not None:
    raise ValueError("SequenceMask.past_k continues one sequence a row: no segment ids or spans.")
  k = jnp.concatenate([mask.past_k.astype(k.dtype), k], axis=1)
  v = jnp.concatenate([mask.past_v.astype(v.dtype), v], axis=1)
  valid_bs = jnp.concatenate([mask.past_valid_bs.astype(jnp.bool_), valid_bs], axis=1)
  return k, v, valid_bs, mask.past_k.shape[1]


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

  def __init__(self, d_model: int, ffn_dim: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
    self.dtype = dtype
    self.gate_kernel = param(rngs, _normal(d_model**-0.5), (d_model, ffn_dim), ("embed", "mlp"))
    self.up_kernel = param(rngs, _normal(d_model**-0.5), (d_model, ffn_dim), ("embed", "mlp"))
    self.down_kernel = param(rngs, _normal(ffn_dim**-0.5), (ffn_dim, d_model), ("mlp", "embed"))
    self.gate_lora = self.up_lora = self.down_lora = None

  def add_adapters(self, spec: lora_lib.LoraSpec, rngs: nnx.Rngs) -> None:
    """Puts LoRA adapters on the projections ``spec`` targets (gate, up, down)."""
    for name in ("gate", "up", "down"):
      kernel = getattr(self, f"{name}_kernel")
      adapter = lora_lib.adapter(name, spec, kernel, 1, dtype=self.dtype, rngs=rngs)
      setattr(self, f"{name}_lora", nnx.data(adapter))

  def _project(self, x: jax.Array, kernel: nnx.Param, adapter) -> jax.Array:
    out = x @ kernel[...].astype(self.dtype)
    return out if adapter is None else out + adapter(x)

  def __call__(self, x_btd: jax.Array) -> jax.Array:
    gate = self._project(x_btd, self.gate_kernel, self.gate_lora)
    up = self._project(x_btd, self.up_kernel, self.up_lora)
    return self._project(jax.nn.silu(gate) * up, self.down_kernel, self.down_lora)
