"""The rollout contract over Ray actors, each writing into a storage unit on its own node.

Each actor hosts a rollout built by a picklable ``factory`` on the actor's local devices (the
runtime passes one; this module knows nothing of configs or builders), and a
:class:`~knitjax.distributed.ray_storage.RayStorageUnit` placed on the actor's node, so a group's
payload is written where it was generated and never passes through the driver: the actors return
only the groups' :class:`GroupMeta`, which the driver offers to the admission index; consumers
fetch the payloads from the units on demand.

Weights: :meth:`RayRollout.adopt` puts a host copy of the parameters in Ray's object store once
per version (one ``ray.put``; every actor reads the same object) and queues the load on every
actor without waiting: an actor runs its calls in submission order, so generation started after
``adopt`` uses the new version, while generation already running finishes on the old one.

Failures: an actor that dies (its process killed, ``RayActorError``) while generating is replaced
by a new actor attached to the same storage unit and given the current weights; whatever the dead
actor had already stored of its share is discarded and the whole share is generated again under
the same group ids, so every group id reaches the driver exactly once. After ``max_restarts``
deaths in all, ``step`` raises one sentence. Storage units get the same ``max_restarts`` (they
are restarted by Ray and replay their spill folder, see `knitjax.distributed.ray_storage`).
``stats()`` counts ``actor_restarts`` and ``groups_regenerated``.

Ray is optional (``pip install -e '.[ray]'``).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from knitjax.distributed.ray_storage import NodeAffinitySchedulingStrategy, RayStorageUnit, ray
from knitjax.distributed.weight_parts import ShardedWeights, WireFormat, assemble
from knitjax.rollout.contract import Rollout, RolloutStats
from knitjax.tasks.prompts import Prompt
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.storage import StorageLimits, StorageUnit

_WAIT_S = 0.5  # a step returns after this long even if no actor finished (the caller polls)


@dataclasses.dataclass(frozen=True)
class HostedRollout:
  """What a factory builds inside an actor: the rollout, a params template, the local mesh."""

  rollout: Rollout
  params: nnx.State  # sharded on ``mesh``; published weights are loaded in its structure
  mesh: jax.sharding.Mesh


# ``factory(storage_unit) -> HostedRollout``, called inside the actor; must pickle (e.g. a
# ``functools.partial`` of a module-level function).
RolloutFactory = Callable[[StorageUnit], HostedRollout]


class _RolloutActor:
  """The actor body: one hosted rollout, fed whole batches of groups by the driver."""

  def __init__(self, factory: RolloutFactory):
    self._factory = factory
    self._hosted: HostedRollout | None = None

  def attach(self, storage: RayStorageUnit) -> None:
    """Builds the rollout, writing to ``storage`` (placed on this node)."""
    self._hosted = self._factory(storage)

  def adopt(self, version: int, pure_params: dict) -> None:
    h = self._hosted
    state = jax.tree.map(lambda x: x, h.params)  # a new State of the same structure
    nnx.replace_by_pure_dict(state, pure_params)
    state = jax.device_put(state, jax.tree.map(lambda x: x.sharding, h.params))
    h.rollout.adopt(state, version)

  def adopt_parts(self, version: int, wire_format: WireFormat, refs: list) -> None:
    """Adopts a version sent as every trainer process's own shards (`weight_parts`)."""
    self.adopt(version, assemble(wire_format, ray.get(list(refs))))

  def generate(self, items: Sequence[tuple[Prompt, int]], key_data: np.ndarray) -> list[GroupMeta]:
    """Generates the given ``(prompt, group id)``s to completion; payloads stay on this node."""
    h = self._hosted
    if h is None or h.rollout.version is None:
      raise RuntimeError("the rollout actor needs weights and a storage unit before generating.")
    rng, todo, metas, call = jax.random.wrap_key_data(key_data), list(items), [], 0
    with jax.set_mesh(h.mesh):
      while todo or h.rollout.inflight:
        while todo and h.rollout.capacity():
          h.rollout.start(*todo.pop(0))
        metas += h.rollout.step(jax.random.fold_in(rng, call) if call else rng)
        call += 1
    return metas

  def node_id(self) -> str:
    return ray.get_runtime_context().get_node_id()

  def pid(self) -> int:
    return os.getpid()


def _send_version(actor, version: int, weights) -> None:
  if isinstance(weights, ShardedWeights):
    actor.adopt_parts.remote(version, weights.wire_format, list(weights.refs))
  else:
    actor.adopt.remote(version, weights)


def publish(params: nnx.State) -> ray.ObjectRef:
  """Host copy of the trainer's params in Ray's object store, read by every actor."""
  return ray.put(jax.tree.map(np.asarray, nnx.to_pure_dict(jax.device_get(params))))


class RayRollout:
  """Rollout actors used as one rollout (the contract of `knitjax.rollout.contract`).

  ``step`` hands the groups started since the last call to idle actors in contiguous shares
  (share ``i`` draws from ``fold_in(rng, i)``), then returns the groups of every actor that has
  finished, waiting up to ``_WAIT_S`` for one.

  Args:
    factory: builds an actor's rollout around its storage unit (see :data:`RolloutFactory`).
    limits: byte budget and validation bounds of each actor's storage unit.
    workers: number of actors; unit ids are ``0..workers-1``.
    groups_per_call: groups one actor generates per call (None: no bound).
    node_ids: Ray node per actor (None: Ray chooses); each unit goes on its actor's node.
    num_cpus: CPUs Ray reserves per actor.
    max_restarts: actor deaths survived in all (rollout actors replaced, storage units restarted
      by Ray); one more ends the run with one sentence.
  """

  def __init__(
    self,
    factory: RolloutFactory,
    limits: StorageLimits,
    workers: int,
    *,
    groups_per_call: int | None = None,
    node_ids: Sequence[str] | None = None,
    num_cpus: float = 1,
    max_restarts: int = 0,
  ):
    if not ray.is_initialized():
      raise RuntimeError("RayRollout needs a running Ray: call ray.init() first.")
    if workers < 1:
      raise ValueError(f"a Ray rollout needs at least one worker, got {workers}.")
    self._factory, self._node_ids, self._num_cpus = factory, node_ids, num_cpus
    self._max_restarts = max_restarts
    self._actors, self._units, self._pids = [], {}, {}
    run = uuid.uuid4().hex[:12]
    # Named, so every trainer process of a multi-process trainer reaches them (`unit_names`).
    self.unit_names = {i: f"knitjax-storage-{run}-{i}" for i in range(workers)}
    for i in range(workers):
      actor = self._spawn(i)
      node = ray.get(actor.node_id.remote())
      # payloads are written where they are made
      unit = RayStorageUnit(
        limits, i, node_id=node, max_restarts=max_restarts, name=self.unit_names[i]
      )
      ray.get(actor.attach.remote(unit))
      self._actors.append(actor)
      self._units[i] = unit
    self._per_call = groups_per_call
    self._version: int | None = None
    self._published = None  # the current version's weights in the object store
    self._pending: list[tuple[Prompt, int]] = []
    # call -> (actor, the share it generates)
    self._running: dict[ray.ObjectRef, tuple[int, list[tuple[Prompt, int]]]] = {}
    self._stats = RolloutStats(shards=workers)

  def _spawn(self, i: int):
    options: dict = {"num_cpus": self._num_cpus}
    if self._node_ids is not None:
      options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self._node_ids[i], soft=False)
    actor = ray.remote(_RolloutActor).options(**options).remote(self._factory)
    self._pids[i] = ray.get(actor.pid.remote())  # asked now: later calls queue behind generate
    return actor

  def _replace(self, i: int, share: list[tuple[Prompt, int]], error: Exception) -> None:
    """Replaces dead actor ``i``; its share goes back to the front of the queue."""
    self._stats.actor_restarts += 1
    if self._stats.actor_restarts > self._max_restarts:
      earlier = self._stats.actor_restarts - 1
      raise RuntimeError(
        f"Ray rollout actor {i} died ({type(error).__name__}) after {earlier} earlier actor "
        f"deaths; config.topology.actor_restarts={self._max_restarts} are survived."
      ) from error
    ray.kill(self._actors[i], no_restart=True)
    actor = self._spawn(i)
    ray.get(actor.attach.remote(self._units[i]))  # the unit outlives its actor (or is restarted)
    # stored before the death, remade below (release skips ids the unit does not hold)
    self._units[i].release([gid for _, gid in share])
    if self._published is not None:
      _send_version(actor, *self._published)
    self._actors[i] = actor
    self._pending[:0] = share
    self._stats.groups_regenerated += len(share)

  @property
  def storage(self) -> Mapping[int, StorageUnit]:
    return dict(self._units)

  @property
  def version(self) -> int | None:
    return self._version

  @property
  def inflight(self) -> int:
    return len(self._pending) + sum(len(share) for _, share in self._running.values())

  def adopt(self, params, version: int) -> None:
    """Hands ``version`` to every actor: ``params`` on this process's devices (copied once into
    the object store), or a multi-process trainer's `ShardedWeights`."""
    if version == self._version:
      return
    weights = params if isinstance(params, ShardedWeights) else publish(params)
    for a in self._actors:
      _send_version(a, version, weights)
    self._version, self._published = version, (version, weights)

  def _idle(self) -> list[int]:
    busy = {a for a, _ in self._running.values()}
    return [i for i in range(len(self._actors)) if i not in busy]

  def capacity(self) -> int:
    if self._per_call is None:
      return 1 << 30
    return max(0, len(self._idle()) * self._per_call - len(self._pending))

  def start(self, prompt: Prompt, group_id: int) -> None:
    if self._version is None:
      raise RuntimeError("the rollout has no policy: call adopt(params, version) first.")
    self._pending.append((prompt, group_id))

  def step(self, rng: jax.Array, *, want_room: bool = False) -> list[GroupMeta]:
    idle = self._idle()
    if self._pending and idle:
      n, k = len(self._pending), len(idle)
      bounds = [n * i // k for i in range(k + 1)]
      for i, actor in enumerate(idle):
        share = self._pending[bounds[i] : bounds[i + 1]]
        if share:
          key = np.asarray(jax.random.key_data(jax.random.fold_in(rng, i)))
          self._running[self._actors[actor].generate.remote(share, key)] = (actor, share)
      self._pending = []
    if not self._running:
      return []
    ready, _ = ray.wait(list(self._running), num_returns=1, timeout=_WAIT_S)
    if ready:  # collect every call that is done by now
      ready, _ = ray.wait(list(self._running), num_returns=len(self._running), timeout=0)
    metas = []
    for ref in sorted(ready, key=lambda r: self._running[r][0]):
      actor, share = self._running.pop(ref)
      try:
        metas += ray.get(ref)
      except ray.exceptions.RayActorError as e:
        self._replace(actor, share, e)
    self._stats.tokens += sum(sum(m.response_tokens) for m in metas)
    return metas

  def stats(self) -> RolloutStats:
    return dataclasses.replace(self._stats)

  def pids(self) -> dict[str, list[int]]:
    """Process ids of the rollout actors and the storage units (fault tests kill them)."""
    return {
      "rollout": [self._pids[i] for i in range(len(self._actors))],
      "storage": [u.pid() for u in self._units.values()],
    }

  def close(self) -> None:
    for a in self._actors:
      ray.kill(a, no_restart=True)
    for u in self._units.values():
      u.close()
