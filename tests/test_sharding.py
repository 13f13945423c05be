"""Tests of mesh construction, the logical-axis rules and sharded init on 8 fake devices."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from knitjax import sharding
from knitjax.models.transformer import Transformer, TransformerConfig

# Heads, kv heads, d_model, ffn and vocab all divide by 8: every big param can be split 8 ways.
CONFIG = TransformerConfig(
  vocab_size=256,
  num_layers=2,
  d_model=128,
  num_heads=8,
  num_kv_heads=8,
  head_dim=16,
  ffn_dim=256,
  tie_embeddings=False,
)
MIN_SIZE = 2**12  # every kernel of CONFIG is at least 128 * 8 * 16 = 16384 elements


def _init(mesh, config=CONFIG):
  return sharding.init_sharded(lambda: Transformer(config, rngs=nnx.Rngs(0)), mesh)


def _arrays(state):
  leaves = jax.tree_util.tree_leaves_with_path(state)
  return {jax.tree_util.keystr(p): x for p, x in leaves if hasattr(x, "sharding")}


def test_make_mesh_infers_one_axis():
  mesh = sharding.make_mesh((2, -1, 2))
  assert mesh.axis_names == sharding.MESH_AXES
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  assert dict(sharding.make_mesh((1, 1, 1), jax.devices()[:1]).shape) == {
    "data": 1,
    "fsdp": 1,
    "tensor": 1,
  }


@pytest.mark.parametrize(
  "shape, message",
  [
    ((2, 2), "3 integers"),
    ((-1, -1, 2), "at most one -1"),
    ((3, -1, 1), "not divisible"),
    ((2, 2, 1), "needs 4 devices but 8"),
    ((0, 8, 1), "positive sizes"),
  ],
)
def test_make_mesh_rejects_shapes_that_do_not_fit(shape, message):
  with pytest.raises(ValueError, match=message):
    sharding.make_mesh(shape)


def test_logical_rules():
  mesh = sharding.make_mesh((2, 2, 2))
  assert sharding.logical_to_spec(("batch", "sequence", "embed")) == P(("data", "fsdp"), None, None)
  assert sharding.logical_to_spec(("vocab", "embed")) == P("tensor", "fsdp")
  # 3 kv heads cannot be split over tensor=2: that dimension is replicated instead.
  assert sharding.logical_to_spec(("embed", "kv_heads", "head_dim"), mesh, (128, 3, 16)) == P(
    "fsdp", None, None
  )
  assert sharding.logical_sharding(mesh, ("mlp", "embed")).spec == P("tensor", "fsdp")
  assert sharding.batch_sharding(mesh, 3).spec == P(("data", "fsdp"), None, None)
  assert sharding.replicated(mesh).is_fully_replicated
  with pytest.raises(ValueError, match="unknown logical axis 'bogus'"):
    sharding.logical_to_spec(("bogus",))


@pytest.mark.parametrize(
  "shape, split",
  [
    ((1, 8, 1), {"embed": 8}),  # FSDP
    ((1, 1, 8), {"heads": 8, "kv_heads": 8, "mlp": 8, "vocab": 8}),  # tensor parallel
    ((1, 2, 4), {"embed": 2, "heads": 4, "kv_heads": 4, "mlp": 4, "vocab": 4}),
  ],
)
def test_params_and_optimizer_state_are_sharded(shape, split):
  mesh = sharding.make_mesh(shape)
  graphdef, state = _init(mesh)
  params = _arrays(state)
  axes = {
    jax.tree_util.keystr(p): v.get_metadata()["out_sharding"]
    for p, v in jax.tree_util.tree_leaves_with_path(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
  }
  for name, x in params.items():
    local = x.addressable_shards[0].data.shape
    logical = axes[name.removesuffix(".value")]
    expected = tuple(d // split.get(a, 1) for d, a in zip(x.shape, logical, strict=True))
    assert local == expected, (name, local, expected)
    if x.size >= MIN_SIZE:
      assert not x.sharding.is_fully_replicated, name
  sharding.assert_params_sharded(state, mesh, min_size=MIN_SIZE)

  # Same values as an eager, unsharded init with the same seed (jit may round the last ulp).
  reference = nnx.state(Transformer(CONFIG, rngs=nnx.Rngs(0)))
  for (_, a), (_, b) in zip(
    jax.tree_util.tree_leaves_with_path(state),
    jax.tree_util.tree_leaves_with_path(reference),
    strict=True,
  ):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

  tx = optax.adamw(1e-3)
  opt_shardings = sharding.optimizer_shardings(tx, state, mesh)
  with jax.set_mesh(mesh):
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(state)
  mu = _arrays(opt_state[0].mu)
  nu = _arrays(opt_state[0].nu)
  assert mu.keys() == params.keys() == nu.keys()
  for name, x in params.items():
    assert mu[name].sharding == x.sharding == nu[name].sharding, name
  assert opt_state[0].count.sharding.is_fully_replicated
  sharding.assert_params_sharded(opt_state, mesh, min_size=MIN_SIZE)


def test_assert_params_sharded_catches_replicated_params():
  mesh = sharding.make_mesh((1, 1, 8))
  # 2 heads cannot be split over tensor=8, so the attention kernels stay replicated.
  config = dataclasses.replace(CONFIG, num_heads=2, num_kv_heads=2, head_dim=64)
  _, state = _init(mesh, config)
  with pytest.raises(ValueError, match="q_kernel"):
    sharding.assert_params_sharded(state, mesh, min_size=MIN_SIZE)


@pytest.mark.parametrize(
  "heads, kv_heads, ffn, vocab, match",
  [
    (28, 4, 64, 64, r"does not divide the model's num_heads=28"),  # Qwen2.5-7B's heads on 8
    (8, 3, 64, 64, r"neither divided by nor a multiple of the model's num_kv_heads \(3\)"),
    (8, 8, 60, 64, r"ffn_dim=60"),
    (8, 8, 64, 100, r"vocab_size=100"),
  ],
)
def test_tensor_axis_must_divide_the_tensor_parallel_dimensions(heads, kv_heads, ffn, vocab, match):
  mesh = sharding.make_mesh((1, 1, 8))
  with pytest.raises(ValueError, match=match):
    sharding.check_tensor_parallel(
      mesh, num_heads=heads, num_kv_heads=kv_heads, ffn_dim=ffn, vocab_size=vocab
    )


def test_fewer_kv_heads_than_tensor_shards_are_replicated_by_the_gqa_rule():
  mesh = sharding.make_mesh((1, 1, 8))
  # 2 KV heads on 8 tensor shards: each replicated on the 4 shards of its query heads.
  sharding.check_tensor_parallel(mesh, num_heads=16, num_kv_heads=2, ffn_dim=64, vocab_size=64)
  # No tensor axis: nothing to check.
  one = sharding.make_mesh((8, 1, 1))
  sharding.check_tensor_parallel(one, num_heads=7, num_kv_heads=7, ffn_dim=9, vocab_size=11)
