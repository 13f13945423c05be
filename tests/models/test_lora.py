"""LoRA adapters on the decoder: exact at step 0, the reference is the base, merge = adapters,
config errors, Hugging Face base and merged export."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from knitjax import sharding
from knitjax.models import hf, lora
from knitjax.models.transformer import Transformer, TransformerConfig
from knitjax.train import step as step_lib

CFG = TransformerConfig(
  vocab_size=32,
  num_layers=2,
  d_model=32,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  ffn_dim=64,
  qk_norm=True,
  tie_embeddings=False,
)
LORA = dataclasses.replace(CFG, lora_rank=4, lora_alpha=8.0)


def _inputs(seed=0, b=2, t=7):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, 32, (b, t)), jnp.int32)
  valid = jnp.asarray(np.arange(t)[None] >= np.array([[0], [2]]))  # row 1 left-padded
  positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
  return tokens, positions, valid


def _init(config, seed=0):
  """(graphdef, params) by a jitted init on one device (eager init dispatches op by op: slow)."""
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  return sharding.init_sharded(lambda: Transformer(config, rngs=nnx.Rngs(seed)), mesh)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, *states):
  return nnx.merge(graphdef, *states)(*_inputs())


def _logits(graphdef, *states):
  return np.asarray(_forward(graphdef, *states))


@pytest.fixture(scope="module")
def seed0():
  """``(plain graphdef, plain params, LoRA graphdef, LoRA params)``, both from seed 0."""
  return (*_init(CFG), *_init(LORA))


def _perturbed(adapters, seed=1):
  """Adapters with a nonzero B (a fresh B is zero), as after some training."""
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
  return jax.tree.unflatten(tree, leaves)


def test_fresh_adapters_leave_the_model_as_it_was(seed0):
  plain, (graphdef, params) = seed0[:2], seed0[2:]
  adapters, base = lora.split(params)
  # The same seed gives the same base: adapters are drawn after every base param.
  assert all(jax.tree.leaves(jax.tree.map(np.array_equal, plain[1], base)))
  # Every targeted projection of every block has an adapter: 7 targets x 2 blocks x (A, B), and
  # each fresh adapter adds exactly zero (B = 0).
  assert len(jax.tree.leaves(adapters)) == 2 * 7 * 2
  mlp = nnx.merge(graphdef, params).blocks[0].mlp
  x = jax.random.normal(jax.random.key(0), (2, 5, CFG.d_model))
  assert np.asarray(mlp.up_lora(x)).any() == 0
  # XLA compiles the model with (zero) adapters a little differently: equal to float rounding
  # (test_fresh_adapters_are_exact_eagerly checks it bit for bit).
  np.testing.assert_allclose(_logits(graphdef, params), _logits(*plain), atol=1e-5, rtol=1e-5)


def test_fresh_adapters_are_exact_eagerly(seed0):
  """The eager forwards (op by op, as XLA does not fuse them) are equal bit for bit. The models
  come from the jitted init: an eager init dispatches op by op too (about 20 s)."""
  plain, model = nnx.merge(*seed0[:2]), nnx.merge(*seed0[2:])
  np.testing.assert_array_equal(model(*_inputs()), plain(*_inputs()))


def test_adapters_change_exactly_the_targeted_projections():
  cfg = dataclasses.replace(LORA, lora_targets=("v", "down"))
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  adapters, _ = lora.split(params)
  names = {path[-2] for path, _ in nnx.to_flat_state(adapters)}
  assert names == {"v_lora", "down_lora"}
  a = nnx.to_flat_state(adapters)[0][1]
  assert a.get_metadata()["lora_scale"] == 8.0 / 4


def test_reference_is_the_base_model_with_adapters_off(seed0):
  """What the train step uses as the reference policy gives the base model's log-probs."""
  plain_graphdef, plain, graphdef, params = seed0
  adapters, base = lora.split(params)
  trained = _perturbed(adapters)
  tokens, positions, valid = _inputs()
  mb = {"tokens": tokens, "positions": positions, "valid": valid, "targets": tokens}
  ref = lora.combine(base, lora.disabled(trained))
  logprobs = jax.jit(lambda g, p: step_lib.sequence_logprobs(g, p, mb, 1.0)[0], static_argnums=0)
  ref_logp, base_logp = logprobs(graphdef, ref), logprobs(plain_graphdef, plain)
  np.testing.assert_allclose(ref_logp, base_logp, atol=1e-5, rtol=1e-5)
  policy_logp = logprobs(graphdef, lora.combine(base, trained))
  assert np.abs(policy_logp - base_logp).max() > 1e-2  # the trained adapters do matter


def test_merged_weights_compute_the_lora_model(seed0):
  plain_graphdef, _, graphdef, params = seed0
  adapters, base = lora.split(params)
  trained = lora.combine(base, _perturbed(adapters))
  merged = lora.merged(trained)
  assert not any(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(merged))
  want = _logits(graphdef, trained)
  got = _logits(plain_graphdef, merged)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  assert np.abs(want - _logits(graphdef, params)).max() > 1e-3


def test_merged_export_loads_back_with_the_lora_models_logits(seed0, tmp_path):
  """Merge-and-export writes a plain Hugging Face folder the existing loader reads."""
  graphdef, params = seed0[2:]
  adapters, base = lora.split(params)
  trained = lora.combine(base, _perturbed(adapters))
  hf.save_hf_params(trained, LORA, tmp_path)
  config, loaded_graphdef, loaded = hf.init_from_hf(tmp_path)
  assert config == CFG
  np.testing.assert_allclose(
    _logits(loaded_graphdef, loaded), _logits(graphdef, trained), atol=2e-5, rtol=1e-5
  )


def test_a_hugging_face_checkpoint_is_the_frozen_base(seed0, tmp_path):
  plain = seed0[1]
  hf.save_hf_params(plain, CFG, tmp_path)
  mesh = sharding.make_mesh((1, 1, -1))
  config, graphdef, params = hf.init_from_hf(tmp_path, mesh, config=LORA, seed=1)
  assert config == LORA
  adapters, base = lora.split(params)
  assert all(jax.tree.leaves(jax.tree.map(np.array_equal, base, plain)))  # read, not drawn
  assert {float(np.abs(b).max()) for (*_, n), b in nnx.to_flat_state(adapters) if n == "b"} == {0}
  # The same folder loaded without LoRA, placed alike: step 0 computes it (sharded over 8
  # devices the partitioner may order the reductions differently, hence the float tolerance).
  _, loaded_graphdef, loaded = hf.init_from_hf(tmp_path, mesh)
  np.testing.assert_allclose(
    _logits(graphdef, params), _logits(loaded_graphdef, loaded), atol=1e-5, rtol=1e-5
  )
  with pytest.raises(ValueError, match="d_model"):
    hf.init_from_hf(tmp_path, config=dataclasses.replace(LORA, d_model=64, head_dim=16))


def test_base_in_bfloat16_keeps_adapters_float32(seed0):
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  params = seed0[3]
  cast = lora.cast_base(params, "bfloat16", mesh)
  adapters, base = lora.split(cast)
  assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
  assert lora.tree_bytes(base) * 2 == lora.tree_bytes(lora.split(params)[1])
  kernel = base["blocks"][0]["mlp"]["up_kernel"][...]
  assert kernel.sharding == params["blocks"][0]["mlp"]["up_kernel"][...].sharding


def test_tree_bytes_counts_concrete_and_abstract_arrays():
  tree = {"a": jnp.zeros((3, 4), jnp.float32), "b": jax.ShapeDtypeStruct((5,), jnp.bfloat16)}
  assert lora.tree_bytes(tree) == 3 * 4 * 4 + 5 * 2


@pytest.mark.parametrize(
  "field, value, match",
  [
    ("lora_rank", -1, "lora_rank must be an integer >= 0"),
    ("lora_rank", 2.0, "lora_rank must be an integer >= 0"),
    ("lora_alpha", 0.0, "lora_alpha must be a finite number > 0"),
    ("lora_targets", ("q", "qkv"), "lora_targets=.* is not accepted"),
    ("lora_targets", ("q", "q"), "lora_targets=.* is not accepted"),
    ("lora_targets", (), "lora_targets=.* is not accepted"),
    ("lora_base_dtype", "int8", "lora_base_dtype must be one of"),
  ],
)
def test_bad_lora_fields_are_named(field, value, match):
  with pytest.raises(ValueError, match=f"TransformerConfig.{match}"):
    dataclasses.replace(LORA, **{field: value})
