"""Mesh axes, the one logical-axis rules table, mesh construction and sharded initialisation.

Params carry logical axis names (`out_sharding` metadata, see `knitjax.models.layers.param`);
this module is the only place that maps those names onto mesh axes.
"""

import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
# Mesh axes that split the batch: pure data parallelism and the data-parallel side of FSDP.
BATCH_AXES = ("data", "fsdp")

# Logical axis name -> mesh axis (or axes); None = replicated along that dimension.
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
  "batch": BATCH_AXES,  # examples: every data-parallel replica and FSDP shard holds its own rows
  "sequence": None,  # whole sequences stay on one device (no sequence parallelism yet)
  "embed": "fsdp",  # FSDP: params split along d_model, all-gathered by XLA at use
  "vocab": "tensor",  # tensor parallelism: embedding rows / logit columns
  "heads": "tensor",  # tensor parallelism: query heads and the output projection
  "kv_heads": "tensor",  # tensor parallelism: key/value heads (replicated if too few: see below)
  "mlp": "tensor",  # tensor parallelism: SwiGLU hidden units
  "head_dim": None,
  "norm": None,  # norm scales are tiny
  "layers": None,  # a stacked-layers axis, if layers are ever scanned
  "lora_rank": None,  # LoRA adapters' rank axis: small, the other axis follows its kernel's
}


def make_mesh(
  shape: Sequence[int], devices: Sequence[jax.Device] | None = None
) -> jax.sharding.Mesh:
  """A (data, fsdp, tensor) mesh with Auto axes; one entry of `shape` may be -1 (inferred)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = tuple(shape)
  if len(shape) != len(MESH_AXES) or not all(isinstance(s, int | np.integer) for s in shape):
    raise ValueError(f"mesh shape must be {len(MESH_AXES)} integers for {MESH_AXES}, got {shape}.")
  if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ValueError(f"mesh shape {shape} must hold positive sizes and at most one -1.")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if len(devices) % known:
      raise ValueError(
        f"mesh shape {shape} cannot be completed: {len(devices)} devices are not divisible by "
        f"{known}."
      )
    shape = tuple(len(devices) // known if s == -1 else s for s in shape)
  if math.prod(shape) != len(devices):
    raise ValueError(
      f"mesh shape {shape} needs {math.prod(shape)} devices but {len(devices)} are available."
    )
  return jax.make_mesh(
    shape,
    MESH_AXES,
    axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
    devices=devices,
  )


def check_tensor_parallel(
  mesh: jax.sharding.Mesh, *, num_heads: int, num_kv_heads: int, ffn_dim: int, vocab_size: int
) -> None:
  """Refuses a decoder whose tensor-parallel dimensions the mesh's "tensor" axis does not divide.

  `logical_to_spec` replicates a dimension its mesh axes do not divide; for the tensor axis that
  would silently turn tensor parallelism off (e.g. Qwen2.5-7B's 28 heads on 8 devices). The one
  accepted exception is the standard GQA rule: with fewer KV heads than tensor shards, each KV
  head is replicated on the shards of its query heads, which needs tensor % num_kv_heads == 0.
  """
  tp = mesh.shape["tensor"]
  if tp == 1:
    return
  dims = {"num_heads": num_heads, "ffn_dim": ffn_dim, "vocab_size": vocab_size}
  if num_kv_heads >= tp:
    dims["num_kv_heads"] = num_kv_heads
  elif tp % num_kv_heads:
    raise ValueError(
      f"the mesh's tensor axis ({tp}) is neither divided by nor a multiple of the model's "
      f"num_kv_heads ({num_kv_heads}); choose a tensor size that is one or the other."
    )
  bad = [f"{name}={size}" for name, size in dims.items() if size % tp]
  if bad:
    raise ValueError(
      f"the mesh's tensor axis ({tp}) does not divide the model's {', '.join(bad)}: tensor "
      f"parallelism would be silently dropped for them; choose a tensor size dividing each, or "
      f"shard with fsdp instead."
    )


def logical_to_spec(
  logical_axes: Sequence[str | None],
  mesh: jax.sharding.Mesh | None = None,
  shape: Sequence[int] | None = None,
) -> PartitionSpec:
  """Maps logical axis names to a PartitionSpec by `LOGICAL_AXIS_RULES`.

  A mesh axis is used by at most one dimension (the first that asks for it). Given `mesh` and
  `shape`, mesh axes that do not divide a dimension are dropped, so that dimension is replicated
  (e.g. 2 kv heads on a tensor axis of 4).
  """
  used: set[str] = set()
  spec = []
  for dim, name in enumerate(logical_axes):
    if name is not None and name not in LOGICAL_AXIS_RULES:
      raise ValueError(
        f"unknown logical axis {name!r}; known axes are {sorted(LOGICAL_AXIS_RULES)}."
      )
    rule = LOGICAL_AXIS_RULES.get(name) if name is not None else None
    mesh_axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
    kept = []
    for axis in mesh_axes:
      if axis in used:
        continue
      if mesh is not None and shape is not None:
        size = math.prod(mesh.shape[a] for a in kept) * mesh.shape[axis]
        if shape[dim] % size:
          continue
      kept.append(axis)
    used.update(kept)
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*spec)


def logical_sharding(
  mesh: jax.sharding.Mesh,
  logical_axes: tuple[str | None, ...],
  shape: Sequence[int] | None = None,
) -> NamedSharding:
  """NamedSharding for an array whose dimensions have these logical names."""
  return NamedSharding(mesh, logical_to_spec(logical_axes, mesh, shape))


def batch_sharding(mesh: jax.sharding.Mesh, ndim: int) -> NamedSharding:
  """Leading axis split over ("data", "fsdp"), the rest replicated."""
  if ndim < 1:
    raise ValueError(f"batch_sharding needs an array with at least one axis, got ndim={ndim}.")
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Fully replicated sharding on `mesh`."""
  return NamedSharding(mesh, PartitionSpec())


def to_host(tree):
  """NumPy copies of a pytree's arrays, each the whole global value, in every process.

  ``np.asarray`` fails on an array sharded over a mesh that spans processes (each process holds
  only its own shards); such leaves are all-gathered first (a collective: every process must
  call this in the same order). On one process this is ``np.asarray``.
  """
  from jax.experimental import multihost_utils

  def one(x):
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
      return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)

  return jax.tree.map(one, tree)


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def _leaf_sharding(x, mesh: jax.sharding.Mesh) -> NamedSharding:
  axes = None
  value = x
  if isinstance(x, nnx.Variable):
    axes = x.get_metadata().get("out_sharding")
    value = x.get_value()
  if axes is None or not hasattr(value, "shape"):
    return replicated(mesh)
  return logical_sharding(mesh, tuple(axes), value.shape)


def state_shardings(state, mesh: jax.sharding.Mesh):
  """Pytree of NamedSharding matching `state` (concrete or abstract nnx.State, or any pytree).

  Variables with logical-axis metadata are sharded by the rules table; everything else (e.g. an
  optimizer step count) is replicated.
  """

  def f(x):
    sharding = _leaf_sharding(x, mesh)
    return x.replace(sharding) if isinstance(x, nnx.Variable) else sharding

  return jax.tree.map(f, state, is_leaf=_is_variable)


def optimizer_shardings(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh):
  """Shardings of `tx.init(params)`: per-param statistics follow their param, the rest replicated.

  Args:
    tx: the optax transformation.
    params: the (concrete or abstract) params state.
    mesh: the mesh.
  """
  abstract_opt_state = jax.eval_shape(tx.init, params)
  param_shardings = state_shardings(params, mesh)
  return optax.tree_map_params(
    tx,
    lambda _, sharding: sharding,
    abstract_opt_state,
    param_shardings,
    transform_non_params=lambda _: replicated(mesh),
    is_leaf=_is_variable,
  )


def init_sharded(
  make_model: Callable[[], nnx.Module], mesh: jax.sharding.Mesh
) -> tuple[nnx.GraphDef, nnx.State]:
  """Builds a model directly into sharded params: eval_shape -> shardings -> jitted init.

  No device ever holds the whole unsharded model (beyond what the rules leave replicated).
  """
  abstract_model = nnx.eval_shape(make_model)
  graphdef, abstract_state = nnx.split(abstract_model)
  shardings = state_shardings(abstract_state, mesh)

  def init():
    return nnx.state(make_model())

  with jax.set_mesh(mesh):
    state = jax.jit(init, out_shardings=shardings)()
  return graphdef, state


def assert_params_sharded(state, mesh: jax.sharding.Mesh, min_size: int = 2**14) -> None:
  """Raises ValueError if an array of at least `min_size` elements is fully replicated.

  Nothing is checked on a single-device mesh.
  """
  if mesh.size == 1:
    return
  leaves = jax.tree_util.tree_leaves_with_path(state)
  replicated_params = [
    f"{jax.tree_util.keystr(path)} {tuple(x.shape)}"
    for path, x in leaves
    if hasattr(x, "sharding") and x.size >= min_size and x.sharding.is_fully_replicated
  ]
  if replicated_params:
    raise ValueError(
      f"params of at least {min_size} elements are fully replicated on mesh {dict(mesh.shape)}: "
      f"{', '.join(replicated_params)}."
    )
