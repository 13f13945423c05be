"""Weight sync: no host detour for any train-mesh layout, bf16 on the wire, async publish."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import array as jax_array
from jax.sharding import NamedSharding, PartitionSpec

from configs import arith_tiny
from knitjax import sharding
from knitjax.config import from_config_dict
from knitjax.runtime.weight_sync import (
  WeightSync,
  resolve_sync_dtype,
  staging_sharding,
  via_host,
)

# FSDP, tensor parallel, data parallel and a mix, on the 4 train devices.
TRAIN_MESHES = {"fsdp": (1, 4, 1), "tensor": (1, 1, 4), "data": (4, 1, 1), "fsdp_tensor": (1, 2, 2)}


@pytest.fixture
def host_reads(monkeypatch):
  """Shapes of the jax.Arrays materialised on the host (``ArrayImpl._value``, the path of
  ``np.asarray`` and of device_put's fallback when no source shard matches a target shard).
  The transfer guard cannot see these on the CPU backend, so they are counted directly."""
  reads = []
  value = jax_array.ArrayImpl._value

  def spy(self):
    reads.append(tuple(self.shape))
    return value.fget(self)

  monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(spy))
  return reads


# A two-layer decoder's params by logical axes (the shapes of configs/arith_tiny.py's model).
LEAVES = {
  "embed": (("vocab", "embed"), (64, 64)),
  **{
    f"layer{i}.{name}": spec
    for i in range(2)
    for name, spec in {
      "q": (("embed", "heads", "head_dim"), (64, 4, 16)),
      "k": (("embed", "kv_heads", "head_dim"), (64, 2, 16)),
      "v": (("embed", "kv_heads", "head_dim"), (64, 2, 16)),
      "o": (("heads", "head_dim", "embed"), (4, 16, 64)),
      "gate": (("embed", "mlp"), (64, 128)),
      "down": (("mlp", "embed"), (128, 64)),
      "norm": (("norm",), (64,)),
    }.items()
  },
  "final_norm": (("norm",), (64,)),
}


def _model(mesh_shape, rollout_devices=4):
  """Random float32 params on a train mesh of ``mesh_shape``, their rollout shardings, the
  rollout mesh and the params' values as NumPy arrays."""
  devices = jax.devices()
  rollout_mesh = sharding.make_mesh((-1, 1, 1), devices=devices[:rollout_devices])
  train_mesh = sharding.make_mesh(mesh_shape, devices=devices[4:])
  rng = np.random.default_rng(0)
  params, rollout_shardings, values = {}, {}, {}
  for name, (axes, shape) in LEAVES.items():
    values[name] = value = rng.normal(size=shape).astype(np.float32)
    params[name] = jax.device_put(value, sharding.logical_sharding(train_mesh, axes, shape))
    rollout_shardings[name] = sharding.logical_sharding(rollout_mesh, axes, shape)
  return params, rollout_shardings, rollout_mesh, values


@pytest.mark.parametrize(
  "mesh,dtype,rollout_devices",
  [(m, d, 4) for m in TRAIN_MESHES for d in ("bfloat16", "float32")]
  + [(m, "bfloat16", 2) for m in ("fsdp", "tensor")],
)
def test_publish_copies_device_to_device_with_exact_values(
  mesh, dtype, rollout_devices, host_reads
):
  """4 rollout devices (as many as train devices): shard-wise; 2: staged on the train mesh."""
  params, rollout_shardings, rollout_mesh, _ = _model(TRAIN_MESHES[mesh], rollout_devices)
  # The counter can fail: a plain device_put reads exactly the leaves `via_host` names.
  pairs = zip(jax.tree.leaves(params), jax.tree.leaves(rollout_shardings), strict=True)
  plain = sum(via_host(x.sharding, d, x.shape) for x, d in pairs)
  jax.block_until_ready(jax.device_put(params, rollout_shardings))
  assert len(host_reads) == plain and (plain > 0) == (mesh != "data")
  host_reads.clear()
  sync = WeightSync(rollout_shardings, sync_dtype=dtype)
  with jax.set_mesh(params["embed"].sharding.mesh):  # as the trainer calls it
    sync.publish(params, 5)
  sync.wait()
  assert host_reads == []
  assert sync.route == ("shard_wise" if rollout_devices == 4 else "staged")
  assert sync.host_leaves(params) == 0
  version, got = sync.take_newer(None)
  sync.close()
  assert version == 5
  want_leaves, got_leaves = jax.tree.leaves(params), jax.tree.leaves(got)
  assert len(got_leaves) == len(want_leaves) >= 10
  for want, x, s in zip(want_leaves, got_leaves, jax.tree.leaves(rollout_shardings), strict=True):
    assert x.dtype == jnp.dtype(dtype) and x.sharding == s
    assert {d for d in x.devices()} == set(rollout_mesh.devices.flat)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(want.astype(dtype)))


def test_async_publish_reads_params_before_the_train_step_donates_them():
  # (The expected values are not read from ``params``: on the CPU a NumPy view of a replicated
  # array would hold its buffer and block the donation.)
  params, rollout_shardings, _, values = _model(TRAIN_MESHES["fsdp"])
  same = jax.tree.map(lambda x: x.sharding, params)
  step = jax.jit(
    lambda p: jax.tree.map(lambda x: x * 0 + 7, p),
    in_shardings=(same,),
    out_shardings=same,
    donate_argnums=0,
  )
  sync = WeightSync(rollout_shardings, sync_dtype="float32")
  sync.publish(params, 1)  # returns before the copy is done
  new = step(params)  # donates the very buffers being published
  assert [k for k, x in params.items() if not x.is_deleted()] == []
  sync.wait()
  _, got = sync.take_newer(None)
  for name, x in got.items():
    np.testing.assert_array_equal(np.asarray(x), values[name])
  assert all(np.all(np.asarray(x) == 7) for x in jax.tree.leaves(new))
  sync.close()


def test_back_to_back_publishes_keep_the_newest_and_count_each():
  params, rollout_shardings, _, _ = _model(TRAIN_MESHES["tensor"])
  sync = WeightSync(rollout_shardings, sync_dtype="bfloat16")
  for v in range(1, 4):
    sync.publish(jax.tree.map(lambda x, v=v: x + v, params), v)
  sync.wait()
  assert sync.published == 3 and sync.publish_s > 0
  assert sync.published_bytes == 3 * sum(x.size * 2 for x in jax.tree.leaves(params))
  version, got = sync.take_newer(1)
  assert version == 3 and sync.take_newer(3) is None
  first = jax.tree.leaves(params)[0]
  np.testing.assert_array_equal(
    np.asarray(jax.tree.leaves(got)[0]), np.asarray((first + 3).astype(jnp.bfloat16))
  )
  sync.close()


def test_staging_layout_keeps_matching_axes_and_replicates_the_rest():
  devices = jax.devices()
  train = sharding.make_mesh((1, 2, 2), devices=devices[4:])
  rollout_tp = sharding.make_mesh((2, 1, 2), devices=devices[:4])
  src = NamedSharding(train, PartitionSpec("fsdp", "tensor"))
  # The rollout's tensor axis has the train mesh's size: that split is kept, fsdp is gathered.
  dst = NamedSharding(rollout_tp, PartitionSpec("fsdp", "tensor"))
  assert staging_sharding(src, dst, (8, 8)).spec == PartitionSpec(None, "tensor")
  dst = NamedSharding(sharding.make_mesh((4, 1, 1), devices=devices[:4]), PartitionSpec())
  assert staging_sharding(src, dst, (8, 8)).is_fully_replicated


def test_sync_dtype_rule_and_config_validation():
  assert resolve_sync_dtype("auto", "bfloat16") == "bfloat16"
  assert resolve_sync_dtype("auto", "float32") == "float32"
  assert resolve_sync_dtype("bfloat16", "float32") == "bfloat16"
  c = arith_tiny.get_config("quick")
  c.sync.dtype = "fp8"
  with pytest.raises(ValueError, match="config.sync.dtype='fp8'"):
    from_config_dict(c)
