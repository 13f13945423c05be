"""config.json RoPE scaling <-> TransformerConfig: both transformers config formats, round trips,
and one named sentence for every refusal."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from knitjax.models import hf
from knitjax.models.layers import RopeScaling, yarn_mscale

BASE = dict(
  model_type="llama",
  vocab_size=64,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=131072,
)
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
LLAMA3_ORIGINAL = dict(LLAMA3, original_max_position_embeddings=8192)
EXPECTED_LLAMA3 = RopeScaling(rope_type="llama3", **LLAMA3_ORIGINAL)


def _v4(rope_scaling: dict, theta: float = 5e5, **fields) -> dict:
  return dict(BASE, rope_theta=theta, rope_scaling=rope_scaling, **fields)


def _v5(rope_parameters: dict, theta: float = 5e5, **fields) -> dict:
  return dict(BASE, rope_parameters=dict(rope_parameters, rope_theta=theta), **fields)


@pytest.mark.parametrize(
  "config",
  [
    _v4(dict(LLAMA3_ORIGINAL, rope_type="llama3")),
    _v4(dict(LLAMA3_ORIGINAL, type="llama3")),  # the legacy key
    _v5(dict(LLAMA3_ORIGINAL, rope_type="llama3")),
    _v5(dict(LLAMA3, rope_type="llama3"), max_position_embeddings=8192),  # transformers' fallback
    # What config_to_hf writes, and what transformers 5 reads: both dicts, agreeing.
    _v4(
      dict(LLAMA3_ORIGINAL, rope_type="llama3"),
      rope_parameters=dict(LLAMA3_ORIGINAL, rope_type="llama3"),
    ),
  ],
  ids=["v4", "v4_legacy_type", "v5", "v5_original_from_max_position", "both"],
)
def test_llama31_scaling_reads_from_either_format(config):
  loaded = hf.config_from_hf(config)
  assert loaded.rope_scaling == EXPECTED_LLAMA3
  assert loaded.rope_theta == 5e5


@pytest.mark.parametrize(
  "config",
  [
    _v4(None),
    _v4({"rope_type": "default"}),
    _v4({"type": "default"}),
    _v5({"rope_type": "default"}),
    dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 5e5}, rope_scaling=None),
  ],
)
def test_default_rope_type_means_no_scaling(config):
  assert hf.config_from_hf(config).rope_scaling is None


def test_yarn_fields_are_resolved_as_transformers_does():
  qwen = dict(BASE, model_type="qwen2", max_position_embeddings=131072)
  yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
  plain = hf.config_from_hf(dict(qwen, rope_scaling=yarn)).rope_scaling
  assert plain == RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)
  assert plain.cos_sin_scale == pytest.approx(0.1 * np.log(4.0) + 1)
  # factor null: max_position_embeddings / original_max_position_embeddings.
  derived = hf.config_from_hf(dict(qwen, rope_scaling=dict(yarn, factor=None))).rope_scaling
  assert derived.factor == 4.0
  # mscale with mscale_all_dim (DeepSeek style) fixes the cos/sin scale; mscale alone does not.
  both = dict(yarn, mscale=0.707, mscale_all_dim=1.0)
  scaled = hf.config_from_hf(dict(qwen, rope_scaling=both)).rope_scaling
  assert scaled.attention_factor == pytest.approx(yarn_mscale(4.0, 0.707) / yarn_mscale(4.0, 1.0))
  alone = hf.config_from_hf(dict(qwen, rope_scaling=dict(yarn, mscale=0.707))).rope_scaling
  assert alone.attention_factor is None
  # beta_fast / beta_slow of 0 or null take the defaults (transformers: `beta_fast or 32`).
  options = dict(yarn, beta_fast=0, beta_slow=None, attention_factor=1.5, truncate=None)
  resolved = hf.config_from_hf(dict(qwen, rope_scaling=options)).rope_scaling
  assert (resolved.beta_fast, resolved.beta_slow) == (None, None)
  # transformers tests `if truncate:`, so null turns truncation off.
  assert (resolved.attention_factor, resolved.truncate) == (1.5, False)


@pytest.mark.parametrize(
  "scaling",
  [
    EXPECTED_LLAMA3,
    RopeScaling(rope_type="linear", factor=2.0),
    RopeScaling(
      rope_type="yarn",
      factor=4.0,
      original_max_position_embeddings=32768,
      beta_fast=16.0,
      attention_factor=1.2,
      truncate=False,
    ),
    None,
  ],
  ids=["llama3", "linear", "yarn", "none"],
)
def test_config_to_hf_round_trips_and_transformers_reads_it(tmp_path, scaling):
  config = dataclasses.replace(hf.config_from_hf(_v4(None)), rope_scaling=scaling)
  written = hf.config_to_hf(config)
  assert hf.config_from_hf(json.loads(json.dumps(written))) == config
  if scaling is None:  # unchanged from before scaling existed
    assert written["rope_scaling"] is None and "rope_parameters" not in written
    return
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("torch")
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  with open(tmp_path / "config.json", "w") as f:
    json.dump(written, f)
  theirs = transformers.AutoConfig.from_pretrained(tmp_path)
  assert theirs.rope_parameters["rope_type"] == scaling.rope_type
  inv_freq, scale = ROPE_INIT_FUNCTIONS[scaling.rope_type](theirs)
  np.testing.assert_allclose(inv_freq.numpy(), scaling.inv_freq(config.head_dim, 5e5), rtol=3e-7)
  assert scale == pytest.approx(scaling.cos_sin_scale, rel=1e-12)


@pytest.mark.parametrize(
  ("change", "message"),
  [
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling has rope type 'dyn"),
    (
      dict(rope_parameters={"rope_type": "longrope"}),
      "rope_parameters has rope type 'longrope'; accepted: null, 'default', 'linear', 'llama3', "
      "'yarn'",
    ),
    (dict(rope_scaling={"type": 3}), "rope_scaling has rope type 3; accepted"),
    (dict(rope_scaling={"rope_type": "linear"}), "rope type 'linear' without the field 'factor'"),
    (
      dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}, max_position_embeddings=None),
      "rope_scaling has rope type 'llama3' without the field 'original_max_position_embeddings'",
    ),
    (
      dict(rope_scaling=dict(LLAMA3_ORIGINAL, rope_type="llama3", high_freq_factor=None)),
      "rope_scaling.high_freq_factor must be a finite number > 0, got None",
    ),
    (
      dict(rope_scaling=dict(LLAMA3_ORIGINAL, rope_type="llama3", high_freq_factor=0.5)),
      r"rope_scaling is not accepted: RopeScaling.high_freq_factor \(0.5\) must be greater",
    ),
    (
      dict(rope_parameters={"rope_type": "linear", "factor": "2"}),
      "rope_parameters.factor must be a finite number > 0, got '2'",
    ),
    (
      dict(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}
      ),
      "rope_scaling.original_max_position_embeddings must be a positive integer, got 0",
    ),
    (
      dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}),
      "rope_scaling.beta_fast must be a finite number > 0, got -1",
    ),
    (
      dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "truncate": 1}),
      "rope_scaling.truncate must be true or false, got 1",
    ),
    (
      dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": "x", "mscale_all_dim": 1}),
      "rope_scaling.mscale must be a finite number, got 'x'",
    ),
    (
      dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
      "rope_scaling.partial_rotary_factor must be 1.0",
    ),
    (
      dict(
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_parameters={"rope_type": "linear", "factor": 4.0},
      ),
      "rope_scaling and rope_parameters give different RoPE scalings",
    ),
    (
      dict(
        rope_scaling={"rope_type": "default"},
        rope_parameters={"rope_type": "linear", "factor": 4.0},
      ),
      "rope_scaling and rope_parameters give different RoPE scalings",
    ),
  ],
)
def test_bad_rope_scaling_is_one_named_sentence(tmp_path, change, message):
  with open(tmp_path / "config.json", "w") as f:
    json.dump(dict(BASE, **change), f)
  with pytest.raises(ValueError, match=f"^config.json .*{message}") as err:
    hf.config_from_hf(tmp_path)
  assert "\n" not in str(err.value)


def test_absurd_depth_is_refused_before_tracing(tmp_path):
  import time

  (tmp_path / "config.json").write_text(json.dumps(dict(BASE, num_hidden_layers=100000)))
  start = time.monotonic()
  with pytest.raises(
    ValueError,
    match=r"^config.json num_hidden_layers=100000 is not accepted; it must be at most 1024",
  ):
    hf.init_from_hf(tmp_path)
  assert time.monotonic() - start < 2


def test_a_model_larger_than_memory_is_one_sentence_with_both_sizes(tmp_path):
  from knitjax.models.hf_config import host_memory_bytes

  big = dict(BASE, hidden_size=65536, intermediate_size=1 << 20, num_hidden_layers=1024)
  big.update(num_attention_heads=512, num_key_value_heads=512, vocab_size=1 << 20)
  (tmp_path / "config.json").write_text(json.dumps(big))
  have = f"{host_memory_bytes() / 2**30:,.1f} GiB"
  with pytest.raises(
    ValueError,
    match=rf"^{tmp_path}/config.json describes a model of [\d,]+ parameters \([\d,.]+ GiB in "
    rf"float32\), more than the {have} of memory of this host\.$",
  ):
    hf.init_from_hf(tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_param_count_is_the_models(family, tied):
  from flax import nnx

  from knitjax.models.hf_config import param_count
  from knitjax.models.transformer import Transformer

  config = hf.config_from_hf(dict(BASE, model_type=family, tie_word_embeddings=tied, head_dim=8))
  state = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Param)
  assert param_count(config) == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
