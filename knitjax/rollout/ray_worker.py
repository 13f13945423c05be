"""Rollout workers as Ray actors, each writing into a storage unit on its own node.

A :class:`RayRolloutWorker` is a Ray actor running the same :class:`RolloutWorker` as the
embedded runtime (sampler on the actor's local devices, rewards, group assembly). Its storage
unit is a :class:`~knitjax.transfer.ray_storage.RayStorageUnit` placed on the actor's node, so a
group's payload is written where it was generated and never passes through the trainer's driver:
``generate`` returns only the groups' :class:`GroupMeta`, which the driver offers to the
admission index; consumers later fetch the payloads from the unit on demand.

Weights: the trainer publishes host copies of its parameters once per version with
:func:`publish` (one ``ray.put``; every worker reads the same object), and each worker puts them
on its devices before generating.

Ray is optional (``pip install -e '.[ray]'``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from knitjax.config import Config
from knitjax.tasks.prompts import Prompt
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.ray_storage import NodeAffinitySchedulingStrategy, RayStorageUnit, ray
from knitjax.transfer.storage import StorageLimits, StorageUnit


class _RolloutActor:
  """The actor body: builds the model skeleton, sampler and worker on the actor's devices."""

  def __init__(self, config: Config, unit_id: int):
    from knitjax import sharding
    from knitjax.runtime import builder

    # Rollout runs on this node's devices only (a 1-axis data mesh over them).
    devices = jax.local_devices()
    config = dataclasses.replace(
      config, mesh=dataclasses.replace(config.mesh, shape=(len(devices), 1, 1))
    )
    self._mesh = builder.build_mesh(config, devices=devices)
    prompts = builder.build_prompts(config)
    graphdef, self._params = builder.build_model(config, self._mesh)
    self._shardings = sharding.state_shardings(self._params, self._mesh)
    self._worker = builder.build_worker(config, graphdef, self._mesh, prompts, storage_unit=unit_id)
    self._storage: RayStorageUnit | None = None
    self._version: int | None = None

  def attach(self, storage: RayStorageUnit) -> None:
    """The storage unit this worker writes to (placed on the same node)."""
    self._storage = storage

  def set_weights(self, version: int, pure_params: dict) -> None:
    if version == self._version:
      return
    state = jax.tree.map(lambda x: x, self._params)  # a new State of the same structure
    nnx.replace_by_pure_dict(state, pure_params)
    self._params = jax.device_put(state, self._shardings)
    self._version = version

  def generate(
    self, prompts: Sequence[Prompt], key_data: np.ndarray, first_group_id: int
  ) -> list[GroupMeta]:
    if self._version is None or self._storage is None:
      raise RuntimeError("the rollout worker needs weights and a storage unit before generating.")
    with jax.set_mesh(self._mesh):
      groups = self._worker.generate(
        self._params,
        prompts,
        version=self._version,
        rng=jax.random.wrap_key_data(key_data),
        first_group_id=first_group_id,
      )
    for g in groups:  # the payload stays on this node
      self._storage.put(g.meta.group_id, g.payload, images=g.images)
    return [g.meta for g in groups]

  def node_id(self) -> str:
    return ray.get_runtime_context().get_node_id()

  def device_count(self) -> int:
    return jax.local_device_count()


def publish(params: nnx.State) -> ray.ObjectRef:
  """Host copy of the trainer's params in Ray's object store, read by every worker."""
  return ray.put(jax.tree.map(np.asarray, nnx.to_pure_dict(jax.device_get(params))))


class RayRolloutWorker:
  """Driver-side handle of one rollout actor and its node-local storage unit.

  Args:
    config: the validated run config (model, task, rollout settings).
    limits: the byte budget and validation bounds of the worker's storage unit.
    unit_id: the storage unit's id (``GroupMeta.storage_unit`` of the groups it writes).
    node_id: Ray node to run on (None: Ray chooses); the unit is placed on the same node.
    num_cpus: CPUs Ray reserves for the actor.
  """

  def __init__(
    self,
    config: Config,
    limits: StorageLimits,
    unit_id: int,
    *,
    node_id: str | None = None,
    num_cpus: float = 1,
  ):
    if not ray.is_initialized():
      raise RuntimeError("RayRolloutWorker needs a running Ray: call ray.init() first.")
    options: dict = {"num_cpus": num_cpus}
    if node_id is not None:
      options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    self.unit_id = unit_id
    self._actor = ray.remote(_RolloutActor).options(**options).remote(config, unit_id)
    # The unit goes on the node the worker runs on: payloads are written where they are made.
    self.node_id = ray.get(self._actor.node_id.remote())
    self.storage = RayStorageUnit(limits, unit_id, node_id=self.node_id)
    ray.get(self._actor.attach.remote(self.storage))

  def set_weights(self, version: int, params_ref: ray.ObjectRef) -> ray.ObjectRef:
    """Starts loading published weights; returns the call's ref (await it with ``ray.get``)."""
    return self._actor.set_weights.remote(version, params_ref)

  def generate_async(
    self, prompts: Sequence[Prompt], *, rng: jax.Array, first_group_id: int
  ) -> ray.ObjectRef:
    """Starts generating one group per prompt; ``ray.get`` gives their ``GroupMeta``."""
    key_data = np.asarray(jax.random.key_data(rng))
    return self._actor.generate.remote(list(prompts), key_data, first_group_id)

  def close(self) -> None:
    ray.kill(self._actor)
    self.storage.close()


class RayRolloutPool:
  """Several rollout workers used as one: same ``generate`` contract as the embedded rollout.

  ``generate`` publishes the params once per version, splits the prompts into contiguous
  shares (group ids and RNG streams follow the share), runs the workers in parallel and returns
  every group's ``GroupMeta`` in prompt order; the payloads are already in the workers' units.
  """

  def __init__(self, workers: Sequence[RayRolloutWorker]):
    if not workers:
      raise ValueError("a rollout pool needs at least one worker.")
    self.workers = list(workers)
    self._published: tuple[int, ray.ObjectRef] | None = None

  @property
  def storage(self) -> dict[int, StorageUnit]:
    return {w.unit_id: w.storage for w in self.workers}

  def generate(
    self,
    params: nnx.State,
    prompts: Sequence[Prompt],
    *,
    version: int,
    rng: jax.Array,
    first_group_id: int,
  ) -> list[GroupMeta]:
    if self._published is None or self._published[0] != version:
      self._published = (version, publish(params))
    ref = self._published[1]
    ray.get([w.set_weights(version, ref) for w in self.workers])
    n, k = len(prompts), len(self.workers)
    bounds = [n * i // k for i in range(k + 1)]
    calls = [
      w.generate_async(
        prompts[bounds[i] : bounds[i + 1]],
        rng=jax.random.fold_in(rng, i),
        first_group_id=first_group_id + bounds[i],
      )
      for i, w in enumerate(self.workers)
      if bounds[i + 1] > bounds[i]
    ]
    return [meta for metas in ray.get(calls) for meta in metas]

  def close(self) -> None:
    for w in self.workers:
      w.close()
