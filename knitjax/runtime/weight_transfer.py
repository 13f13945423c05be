"""Weight sync across processes: the rollout process pulls each version from the trainer's.

In multi-controller JAX a ``jax.device_put`` may not move an array onto devices of another
process set, so `WeightSync` (one process) does not carry over. This module uses
``jax.experimental.transfer`` (in JAX 0.10.2): the trainer process runs a transfer server and
stages each version under pull ids; the rollout process connects and pulls it straight into arrays
with its own shardings. The bytes go device buffer to socket to device buffer; neither side
materialises the params as NumPy.

The trainer stages each version exactly as `WeightSync` does (cast to the wire dtype, jitted,
fresh buffers the next train step cannot donate away) into the *wire sharding*: the rollout's
partition spec on the train mesh, with the dimensions replicated whose mesh axis has another
size there. Shard ``i`` of the pull then gets the slice the rollout's device ``i`` needs; with
a data-parallel rollout mesh every leaf is replicated on the wire (measured to work with 4 train
and 2 rollout devices).

Version discovery is the caller's: the rollout must learn under which pull id version ``v`` is
staged and then ``pull(id)``; rollout hosts (`knitjax.runtime.rollout_hosts`) learn it from the
trainer's ``adopt`` call on their control connection, one id per host and version. Each pull id
serves one pull; the trainer keeps the staged arrays of an id until it is pulled, so it
stages only versions the rollout will take (the hosts' ``adopt``, which the rollout thread calls
for the newest version only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import transfer
from jax.sharding import NamedSharding, PartitionSpec

from knitjax.runtime.weight_sync import SYNC_DTYPES, wire_dtype, wire_spec


def leaf_uuids(pull_id: int, n: int) -> range:
  """Transfer ids of a pull id's ``n`` leaves. One pull per leaf: on the CPU backend of JAX
  0.10.2 a pull of several arrays failed ("Async transfer object was deleted before transfers
  completed") when the two sides had different device counts (4 train, 2 rollout), while
  single-array pulls succeeded."""
  return range(pull_id * n, (pull_id + 1) * n)


class WeightServer:
  """The trainer process's side: stages versions for the rollout process to pull.

  Args:
    train_mesh: the trainer's mesh (its devices are local to this process).
    rollout_specs: pytree (the params' structure) of the rollout's PartitionSpecs.
    rollout_shape: axis sizes of the rollout mesh, e.g. ``{"data": 4, "fsdp": 1, "tensor": 1}``.
    sync_dtype: wire dtype, ``"bfloat16"`` or ``"float32"``.
    address: where the transfer server listens (``"[::]:0"``: any interface, a free port).
  """

  def __init__(
    self, train_mesh, rollout_specs, rollout_shape: dict, *, sync_dtype: str, address="[::]:0"
  ):
    if sync_dtype not in SYNC_DTYPES:
      raise ValueError(f"sync_dtype={sync_dtype!r} is not accepted; choose one of {SYNC_DTYPES}.")
    self._mesh, self._rollout_shape, self.sync_dtype = train_mesh, dict(rollout_shape), sync_dtype
    self._specs = jax.tree.leaves(rollout_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    client = train_mesh.devices.flat[0].client
    self._server = transfer.start_transfer_server(client, address, [address])
    self._stage = None

  @property
  def address(self) -> str:
    """The address the rollout process connects to."""
    return self._server.address()

  def _build_stage(self, leaves):
    if len(leaves) != len(self._specs):
      raise ValueError(
        f"published params have {len(leaves)} leaves but the rollout specs {len(self._specs)}."
      )
    wire = [
      NamedSharding(self._mesh, wire_spec(s, self._rollout_shape, self._mesh, x.ndim))
      for x, s in zip(leaves, self._specs, strict=True)
    ]
    dtypes = [wire_dtype(x.dtype, self.sync_dtype) for x in leaves]

    def stage(xs):
      return [jnp.array(x.astype(t), copy=True) for x, t in zip(xs, dtypes, strict=True)]

    return jax.jit(stage, out_shardings=wire)

  def stage(self, params, *pull_ids: int) -> None:
    """Stages ``params`` once under each pull id (e.g. the version), one pull per id
    (does not wait for the pulls)."""
    leaves = jax.tree.leaves(params)
    if self._stage is None:
      self._stage = self._build_stage(leaves)
    staged = self._stage(leaves)
    for pull_id in pull_ids:
      for uuid, x in zip(leaf_uuids(pull_id, len(leaves)), staged, strict=True):
        self._server.await_pull(uuid, [x])


class WeightClient:
  """The rollout process's side: pulls staged versions into arrays on the rollout mesh.

  Args:
    server_address: the trainer's `WeightServer.address`.
    abstract_params: pytree of ``jax.ShapeDtypeStruct`` with the rollout shardings and the wire
      dtype (what each pull returns).
    address: where this process's own transfer server listens.
  """

  def __init__(self, server_address: str, abstract_params, *, address="[::]:0"):
    leaves, self._treedef = jax.tree.flatten(abstract_params)
    self._avals = leaves
    client = next(iter(leaves[0].sharding.device_set)).client
    self._server = transfer.start_transfer_server(client, address, [address])
    self._conn = self._server.connect(server_address)

  def pull(self, pull_id: int):
    """The params staged under ``pull_id`` (waits until they are staged and arrive)."""
    uuids = leaf_uuids(pull_id, len(self._avals))
    leaves = [self._conn.pull(u, [a])[0] for u, a in zip(uuids, self._avals, strict=True)]
    return jax.tree.unflatten(self._treedef, leaves)
