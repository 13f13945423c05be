"""RoPE scaling: frequencies and cos/sin scale against transformers' own functions, validation,
hashability, and plain RoPE unchanged."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from knitjax.models import layers
from knitjax.models.layers import RopeScaling
from knitjax.models.transformer import TransformerConfig

LLAMA31 = RopeScaling(
  rope_type="llama3",
  factor=8.0,
  original_max_position_embeddings=8192,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
)
YARN = RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)
LINEAR = RopeScaling(rope_type="linear", factor=2.0)
# (scaling, rope_theta): Llama-3.1, Qwen2.5 YaRN, a tiny-context llama3 whose every band is hit,
# YaRN with every option set, and linear.
CASES = {
  "llama31": (LLAMA31, 500_000.0),
  "llama3_tiny_context": (dataclasses.replace(LLAMA31, original_max_position_embeddings=32), 1e4),
  "qwen25_yarn": (YARN, 1e6),
  "yarn_options": (
    RopeScaling(
      rope_type="yarn",
      factor=3.3,
      original_max_position_embeddings=50,
      beta_fast=16.0,
      beta_slow=2.0,
      attention_factor=1.25,
      truncate=False,
    ),
    12_345.6,
  ),
  "linear": (LINEAR, 1e4),
}


def _transformers_inv_freq(scaling: RopeScaling, theta: float, head_dim: int):
  """transformers' own `ROPE_INIT_FUNCTIONS` on the equivalent config: (inv_freq, cos/sin scale)."""
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  fields = {f.name: getattr(scaling, f.name) for f in dataclasses.fields(scaling)}
  params = {k: v for k, v in fields.items() if v is not None}
  config = transformers.LlamaConfig(
    hidden_size=4 * head_dim,
    num_attention_heads=4,
    head_dim=head_dim,
    max_position_embeddings=1 << 20,
    rope_parameters=dict(params, rope_theta=theta),
  )
  inv_freq, scale = ROPE_INIT_FUNCTIONS[scaling.rope_type](config)
  return inv_freq.numpy(), scale


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("name", sorted(CASES))
def test_frequencies_match_transformers(name, head_dim):
  scaling, theta = CASES[name]
  expected, scale = _transformers_inv_freq(scaling, theta, head_dim)
  got = scaling.inv_freq(head_dim, theta)
  assert got.dtype == np.float32 and got.shape == (head_dim // 2,)
  # Same float32 steps; at most the last bits differ (transformers 5.25 orders llama3's
  # smoothing ops differently from 5.24: up to 3.4e-7 relative, 3 float32 ulps).
  np.testing.assert_allclose(got, expected, rtol=5e-7, atol=0)
  assert scaling.cos_sin_scale == pytest.approx(scale, rel=1e-12)


def test_each_type_changes_the_frequencies_where_it_should():
  plain = 1.0 / 1e4 ** (np.arange(0, 16, 2) / 16)
  llama3 = CASES["llama3_tiny_context"][0].inv_freq(16, 1e4)
  wavelen = 2 * np.pi / plain  # high band (< 32/4) kept, low band (> 32/1) divided by 8
  np.testing.assert_allclose(llama3[wavelen < 8], plain[wavelen < 8], rtol=1e-6)
  np.testing.assert_allclose(llama3[wavelen > 32], plain[wavelen > 32] / 8, rtol=1e-6)
  assert np.any((wavelen > 8) & (wavelen < 32))  # and the blended middle lies between
  middle = (wavelen > 8) & (wavelen < 32)
  assert np.all((llama3[middle] < plain[middle]) & (llama3[middle] > plain[middle] / 8))
  np.testing.assert_allclose(LINEAR.inv_freq(16, 1e4), plain / 2, rtol=1e-6)
  assert YARN.cos_sin_scale == pytest.approx(0.1 * np.log(4.0) + 1)
  assert LINEAR.cos_sin_scale == LLAMA31.cos_sin_scale == 1.0


def test_sin_cos_carry_the_scaling_and_plain_rope_is_unchanged():
  positions = jnp.arange(40)[None]
  sin, cos = layers.rope_sin_cos(positions, 16, 1e4)
  # The formula of plain RoPE before scaling existed, bit for bit.
  angles = positions.astype(jnp.float32)[..., None] * (
    1.0 / (1e4 ** (jnp.arange(0, 16, 2, dtype=jnp.float32) / 16))
  )
  np.testing.assert_array_equal(sin, jnp.sin(angles))
  np.testing.assert_array_equal(cos, jnp.cos(angles))
  yarn = dataclasses.replace(YARN, original_max_position_embeddings=32)
  sin_y, cos_y = layers.rope_sin_cos(positions, 16, 1e4, yarn)
  angles_y = np.arange(40)[:, None] * yarn.inv_freq(16, 1e4)
  np.testing.assert_allclose(sin_y[0], np.sin(angles_y) * yarn.cos_sin_scale, atol=1e-6)
  np.testing.assert_allclose(cos_y[0], np.cos(angles_y) * yarn.cos_sin_scale, atol=1e-6)


def test_configs_with_scaling_are_hashable_static_arguments():
  config = TransformerConfig(
    vocab_size=8,
    num_layers=1,
    d_model=8,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    ffn_dim=8,
    rope_scaling=LLAMA31,
  )
  same = dataclasses.replace(config, rope_scaling=dataclasses.replace(LLAMA31))
  assert hash(config) == hash(same) and config == same
  assert config != dataclasses.replace(config, rope_scaling=YARN)
  # A mapping of the fields (as a ConfigDict gives it) becomes a RopeScaling.
  fields = {f.name: getattr(LLAMA31, f.name) for f in dataclasses.fields(RopeScaling)}
  assert dataclasses.replace(config, rope_scaling=fields) == config
  jitted = jax.jit(lambda x, c: x * c.rope_scaling.factor, static_argnums=1)
  assert jitted(1.0, config) == 8.0


@pytest.mark.parametrize(
  ("fields", "message"),
  [
    (dict(rope_type="dynamic", factor=2.0), r"rope_type must be one of \['linear', 'llama3'"),
    (dict(rope_type="linear", factor=0.0), "factor must be a finite number > 0, got 0.0"),
    (dict(rope_type="linear", factor=float("inf")), "factor must be a finite number > 0, got inf"),
    (dict(rope_type="linear", factor=2.0, beta_fast=8.0), "beta_fast is not used by .*'linear'"),
    (dict(rope_type="llama3", factor=8.0), "original_max_position_embeddings must be a positive"),
    (
      dict(LLAMA31.__dict__, low_freq_factor=4.0, high_freq_factor=1.0),
      r"high_freq_factor \(1.0\) must be greater than low_freq_factor \(4.0\)",
    ),
    (dict(LLAMA31.__dict__, low_freq_factor=None), "low_freq_factor must be a finite number > 0"),
    (dict(YARN.__dict__, beta_slow=-1.0), "beta_slow must be a finite number > 0"),
    (dict(YARN.__dict__, truncate="yes"), "truncate must be true, false or None, got 'yes'"),
    (dict(YARN.__dict__, original_max_position_embeddings=0.5), "must be a positive integer"),
  ],
)
def test_bad_scalings_are_one_named_sentence(fields, message):
  with pytest.raises(ValueError, match=f"^RopeScaling.*{message}") as err:
    RopeScaling(**fields)
  assert "\n" not in str(err.value)


@pytest.mark.parametrize(
  ("value", "message"),
  [
    ("llama3", "rope_scaling must be a RopeScaling, a mapping of its fields or None, got 'llama3'"),
    (dict(rope_type="linear", factor=2.0, scale=1), "rope_scaling has no field 'scale'"),
    (dict(factor=2.0), "rope_scaling needs rope_type and factor"),
    (
      dict(rope_type="linear", factor=-1),
      "rope_scaling is not accepted: RopeScaling.factor must be a finite number > 0, got -1",
    ),
  ],
)
def test_bad_rope_scaling_in_a_transformer_config(value, message):
  with pytest.raises(ValueError, match=f"^TransformerConfig.{message}"):
    TransformerConfig(
      vocab_size=8,
      num_layers=1,
      d_model=8,
      num_heads=2,
      num_kv_heads=1,
      head_dim=4,
      ffn_dim=8,
      rope_scaling=value,
    )
