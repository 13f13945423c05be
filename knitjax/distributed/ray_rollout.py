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
``stats()`` counts ``actor_restarts`` and ``groups_regenerated``. An actor whose node Ray has
marked dead is not replaced but dropped, with one log line: the run goes on with one actor
fewer (its share generated again by the others).

Scaling: :meth:`RayRollout.scale` changes the number of actors of a running rollout (the run's
`knitjax.distributed.elastic.ScaleWatch` calls it on a ``python -m knitjax.scale`` request). A
new actor joins at the newest adopted version without holding up the others; a retired one
finishes the share it is generating and leaves; its storage unit stays until its groups are
consumed.

Ray is optional (``pip install -e '.[ray]'``).
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from absl import logging
from flax import nnx

from knitjax.distributed.ray_storage import NodeAffinitySchedulingStrategy, RayStorageUnit, ray
from knitjax.distributed.weight_parts import ShardedWeights, WireFormat, assemble
from knitjax.rollout.contract import Rollout, RolloutStats
from knitjax.tasks.prompts import Prompt
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.storage import StorageLimits, StorageUnit

_WAIT_S = 0.5  # a step returns after this long even if no actor finished (the caller polls)
_CLOSE_AFTER_S = 10.0  # a drained unit is closed this long after it left the storage mapping


@dataclasses.dataclass(frozen=True)
class HostedRollout:
  """What a factory builds inside an actor: the rollout, a params template, the local mesh."""

  rollout: Rollout
  params: nnx.State  # sharded on ``mesh``; published weights are loaded in its structure
  mesh: jax.sharding.Mesh
  warmup: Prompt | None = None  # generated once by an actor that joins a running rollout


_WARMUP_ID = -1  # the warm-up group's id in the actor's own unit, released at once

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
    self._hosted, self._storage = self._factory(storage), storage

  def warm(self, key_data: np.ndarray) -> None:
    """Generates one throw-away group with the adopted weights, so this actor's first share is
    not held up by compiling (and does not fall far behind the trainer meanwhile)."""
    if self._hosted.warmup is not None:
      self.generate([(self._hosted.warmup, _WARMUP_ID)], key_data)
      self._storage.release([_WARMUP_ID])

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


class _Units(Mapping):
  """A live, read-only view of a rollout's storage units: the trainer's preparer keeps it for the
  whole run while units join and leave. The rollout replaces its dict instead of changing it, so
  every read here sees one consistent dict."""

  def __init__(self, owner: RayRollout):
    self._owner = owner

  def __getitem__(self, unit_id: int) -> StorageUnit:
    return self._owner._units[unit_id]

  def __iter__(self):
    return iter(self._owner._units)

  def __len__(self) -> int:
    return len(self._owner._units)

  def values(self):
    return self._owner._units.values()

  def items(self):
    return self._owner._units.items()


@dataclasses.dataclass
class _Worker:
  """One rollout actor and how far it has come: joining (``node`` unknown or ``attached`` not
  done), working, or retiring (finishes its running call, then leaves)."""

  actor: object
  node_ref: object = None  # the actor's node id, asked at spawn
  pid_ref: object = None
  node: str | None = None
  attached: list | None = None  # the attach call (and a warm-up), while they run
  pid: int | None = None
  retiring: bool = False

  @property
  def ready(self) -> bool:
    return self.pid is not None


class RayRollout:
  """Rollout actors used as one rollout (the contract of `knitjax.rollout.contract`).

  ``step`` hands the groups started since the last call to idle actors in contiguous shares
  (share ``i`` draws from ``fold_in(rng, i)``), then returns the groups of every actor that has
  finished, waiting up to ``_WAIT_S`` for one.

  Elastic: ``scale(n)`` (any thread) asks for ``n`` actors; ``step`` applies it. A new actor
  gets a new storage unit id (ids are never reused: a retired actor's unit stays until every
  group it holds is consumed or rejected), joins without blocking the running ones, is given the
  newest adopted version, and takes shares once its rollout is built. A retired actor takes no
  new share: its running call finishes and its groups are returned like any others, so no group
  is lost or returned twice. Which groups start, and when, stays the caller's (the rollout
  thread's depth bound and admission), whatever the number of actors.

  Args:
    factory: builds an actor's rollout around its storage unit (see :data:`RolloutFactory`).
    limits: byte budget and validation bounds of each actor's storage unit.
    workers: number of actors at the start; unit ids are ``0..workers-1``.
    groups_per_call: groups one actor generates per call (None: no bound).
    node_ids: Ray node per starting actor (None: Ray chooses); each unit goes on its actor's node.
    num_cpus: CPUs Ray reserves per actor.
    max_restarts: actor deaths survived in all (rollout actors replaced, storage units restarted
      by Ray); one more ends the run with one sentence. An actor whose node is gone for good is
      dropped instead (one log line; the run goes on with one actor fewer).
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
    self._factory, self._limits, self._node_ids = factory, limits, node_ids
    self._num_cpus, self._max_restarts = num_cpus, max_restarts
    self._run = uuid.uuid4().hex[:12]
    self._workers: dict[int, _Worker] = {}
    self._units: dict[int, RayStorageUnit] = {}  # replaced, never changed (see `_Units`)
    self._draining: set[int] = set()  # units of retired actors, closed once empty
    self._closing: list[tuple[float, RayStorageUnit]] = []  # empty, out of the mapping
    self._drain_checked = 0.0
    self._nodes_checked = 0.0
    # Named, so every trainer process of a multi-process trainer reaches them (`unit_names`).
    self.unit_names: dict[int, str] = {}
    self._per_call = groups_per_call
    self._version: int | None = None
    self._published = None  # the current version's weights in the object store
    self._pending: list[tuple[Prompt, int]] = []
    # call -> (actor, the share it generates)
    self._running: dict[ray.ObjectRef, tuple[int, list[tuple[Prompt, int]]]] = {}
    self._stats = RolloutStats(shards=workers)
    self._target, self._next_id = workers, 0
    for _ in range(workers):
      self._spawn()
    for i in list(self._workers):
      self._join(i, block=True)

  # ---- actors joining and leaving ------------------------------------------------------------

  def _spawn(self) -> int:
    i, self._next_id = self._next_id, self._next_id + 1
    node = self._node_ids[i] if self._node_ids is not None and i < len(self._node_ids) else None
    options: dict = {"num_cpus": self._num_cpus}
    if node is not None:
      options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    actor = ray.remote(_RolloutActor).options(**options).remote(self._factory)
    # asked now: later calls queue behind generate
    self._workers[i] = _Worker(actor, node_ref=actor.node_id.remote(), pid_ref=actor.pid.remote())
    return i

  def _join(self, i: int, *, block: bool = False) -> None:
    """Moves joining actor ``i`` on: placed -> its unit made and the rollout built -> ready."""
    w = self._workers[i]
    if w.node is None:
      if not block and not ray.wait([w.node_ref], timeout=0)[0]:
        return  # not placed yet (a new node may be coming up)
      w.node = ray.get(w.node_ref)
    if i not in self._units:
      # payloads are written where they are made
      self.unit_names[i] = f"knitjax-storage-{self._run}-{i}"
      unit = RayStorageUnit(
        self._limits, i, node_id=w.node, max_restarts=self._max_restarts,
        name=self.unit_names[i],
      )  # fmt: skip
      self._units = {**self._units, i: unit}
    if w.attached is None:
      w.attached = [w.actor.attach.remote(self._units[i])]
      if self._published is not None:  # queued behind attach: the newest adopted version
        _send_version(w.actor, *self._published)
        # joined mid-run: ready once it has generated, so its first share is not a compile
        key = np.asarray(jax.random.key_data(jax.random.key(i)))
        w.attached.append(w.actor.warm.remote(key))
    calls = [*w.attached, w.pid_ref]
    if not block and len(ray.wait(calls, num_returns=len(calls), timeout=0)[0]) < len(calls):
      return
    ray.get(calls)
    w.pid, w.attached = ray.get(w.pid_ref), None
    self._stats.shards = sum(x.ready and not x.retiring for x in self._workers.values())

  def scale(self, workers: int) -> None:
    """Asks for ``workers`` actors; the next ``step`` starts or retires the difference."""
    if workers < 1:
      raise ValueError(f"a Ray rollout needs at least one worker, got {workers}.")
    self._target = workers

  @property
  def workers(self) -> int:
    """Actors generating or joining (retiring ones not counted)."""
    return sum(not w.retiring for w in self._workers.values())

  def members(self) -> dict:
    """The count ``asked`` for (lowered when a worker's node is gone), and the unit ids of the
    actors ``working`` (built, taking shares), ``joining`` and ``leaving`` (finishing their last
    share), and of the units ``draining`` (their actor gone, groups still held); read from any
    thread."""
    workers = dict(self._workers)
    return {
      "asked": self._target,
      "working": sorted(i for i, w in workers.items() if w.ready and not w.retiring),
      "joining": sorted(i for i, w in workers.items() if not w.ready and not w.retiring),
      "leaving": sorted(i for i, w in workers.items() if w.retiring),
      "draining": sorted(self._draining),
    }

  def _rescale(self) -> None:
    live = sorted(i for i, w in self._workers.items() if not w.retiring)
    for _ in range(self._target - len(live)):
      self._spawn()
    # fewest losses first: actors still joining, then the newest working ones
    extra = sorted(live, key=lambda i: (self._workers[i].ready, -i))
    for i in extra[: max(0, len(live) - self._target)]:
      self._retire(i)
    for i in [i for i, w in self._workers.items() if not w.ready]:
      try:
        self._join(i)
      except ray.exceptions.RayActorError as e:  # died while joining: the next step spawns another
        logging.warning("Ray rollout worker %d died while joining (%s).", i, type(e).__name__)
        self._workers.pop(i)
        if i in self._units:
          unit = self._units[i]
          self._units = {k: u for k, u in self._units.items() if k != i}
          unit.close()
    self._close_drained()

  def _busy(self) -> set[int]:
    return {a for a, _ in self._running.values()}

  def _retire(self, i: int) -> None:
    w = self._workers[i]
    w.retiring = True
    if i not in self._busy():
      self._leave(i)

  def _leave(self, i: int) -> None:
    """Ends retired actor ``i``; its unit stays until the groups it holds are released."""
    ray.kill(self._workers.pop(i).actor, no_restart=True)
    if i in self._units:
      self._draining.add(i)
    self._stats.shards = sum(w.ready and not w.retiring for w in self._workers.values())
    logging.info("Ray rollout worker %d left; %d working or joining.", i, self.workers)

  def _close_drained(self, every_s: float = 1.0) -> None:
    if not (self._draining or self._closing) or time.monotonic() - self._drain_checked < every_s:
      return
    now = self._drain_checked = time.monotonic()
    for i in sorted(self._draining):
      if self._units[i].stats()["groups"] == 0:  # every group it held consumed or rejected
        self._closing.append((now, self._units[i]))
        self._units = {k: u for k, u in self._units.items() if k != i}
        self._draining.discard(i)
    # closed a while after it left the mapping: a reader in another thread (the step metrics)
    # may still hold the dict it was in
    while self._closing and now - self._closing[0][0] > _CLOSE_AFTER_S:
      self._closing.pop(0)[1].close()

  def _replace(self, i: int, share: list[tuple[Prompt, int]], error: Exception) -> None:
    """Replaces dead actor ``i``, or drops it when its node is gone for good; either way its
    share goes back to the front of the queue."""
    w = self._workers[i]
    if isinstance(error, ray.exceptions.ActorUnavailableError):
      # unreachable, not dead: its node may be dying (Ray marks a node dead only after its
      # health checks fail, up to about a minute): wait for the node's fate before replacing
      deadline = time.monotonic() + _NODE_FATE_S
      while _node_alive(w.node) and time.monotonic() < deadline:
        time.sleep(1.0)
    if not _node_alive(w.node):
      self._drop(i, share, error)
      return
    if w.retiring:  # it was leaving: the others take its share, nothing is restarted
      self._units[i].release([gid for _, gid in share])
      self._leave(i)
      self._pending[:0] = share
      self._stats.groups_regenerated += len(share)
      return
    self._stats.actor_restarts += 1
    if self._stats.actor_restarts > self._max_restarts:
      earlier = self._stats.actor_restarts - 1
      raise RuntimeError(
        f"Ray rollout actor {i} died ({type(error).__name__}) after {earlier} earlier actor "
        f"deaths; config.topology.actor_restarts={self._max_restarts} are survived."
      ) from error
    ray.kill(w.actor, no_restart=True)
    options: dict = {"num_cpus": self._num_cpus}
    if self._node_ids is not None and i < len(self._node_ids):
      options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self._node_ids[i], soft=False)
    actor = ray.remote(_RolloutActor).options(**options).remote(self._factory)
    ray.get(actor.attach.remote(self._units[i]))  # the unit outlives its actor (or is restarted)
    # stored before the death, remade below (release skips ids the unit does not hold)
    self._units[i].release([gid for _, gid in share])
    if self._published is not None:
      _send_version(actor, *self._published)
    self._workers[i] = _Worker(actor, node=w.node, pid=ray.get(actor.pid.remote()))
    self._pending[:0] = share
    self._stats.groups_regenerated += len(share)

  def _drop(self, i: int, share: list[tuple[Prompt, int]], error: Exception) -> None:
    """Actor ``i``'s node is gone: the run goes on without it (and without its unit, which died
    with the node); its share is generated again by the others."""
    node = self._workers.pop(i).node
    self._units = {k: u for k, u in self._units.items() if k != i}
    self._stats.lost_units += (i,)  # the runtime gives up the groups the unit held
    self._draining.discard(i)
    self._target = max(1, self._target - 1)
    if not self._workers:
      raise RuntimeError(
        f"Ray rollout actor {i} died with its node ({type(error).__name__}) and no rollout "
        "actor is left; check the Ray cluster (`ray status`) and rerun to resume."
      ) from error
    logging.warning(
      "Ray rollout worker %d is gone with its node %s; the run goes on with %d workers "
      "(python -m knitjax.scale asks for more).",
      i, node, self.workers,
    )  # fmt: skip
    self._stats.shards = sum(w.ready and not w.retiring for w in self._workers.values())
    self._pending[:0] = share
    self._stats.groups_regenerated += len(share)

  # ---- the rollout contract -----------------------------------------------------------------

  @property
  def storage(self) -> Mapping[int, StorageUnit]:
    return _Units(self)

  @property
  def version(self) -> int | None:
    return self._version

  @property
  def inflight(self) -> int:
    return len(self._pending) + sum(len(share) for _, share in self._running.values())

  def adopt(self, params, version: int) -> None:
    """Hands ``version`` to every actor: ``params`` on this process's devices (copied once into
    the object store), or a multi-process trainer's `ShardedWeights`. A joining actor gets it
    queued behind its attach."""
    if version == self._version:
      return
    weights = params if isinstance(params, ShardedWeights) else publish(params)
    self._version, self._published = version, (version, weights)
    for w in self._workers.values():
      if not w.retiring and (w.ready or w.attached is not None):
        _send_version(w.actor, version, weights)

  def _idle(self) -> list[int]:
    busy = self._busy()
    return [i for i, w in self._workers.items() if w.ready and not w.retiring and i not in busy]

  def capacity(self) -> int:
    if self._per_call is None:
      return 1 << 30
    return max(0, len(self._idle()) * self._per_call - len(self._pending))

  def start(self, prompt: Prompt, group_id: int) -> None:
    if self._version is None:
      raise RuntimeError("the rollout has no policy: call adopt(params, version) first.")
    self._pending.append((prompt, group_id))

  def step(self, rng: jax.Array, *, want_room: bool = False) -> list[GroupMeta]:
    self._rescale()
    self._drop_idle_on_dead_nodes()
    idle = self._idle()
    if self._pending and idle:
      n, k = len(self._pending), len(idle)
      bounds = [n * i // k for i in range(k + 1)]
      for i, actor in enumerate(idle):
        share = self._pending[bounds[i] : bounds[i + 1]]
        if share:
          key = np.asarray(jax.random.key_data(jax.random.fold_in(rng, i)))
          ref = self._workers[actor].actor.generate.remote(share, key)
          self._running[ref] = (actor, share)
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
        continue
      if self._workers[actor].retiring:  # its share is done: it leaves
        self._leave(actor)
    self._stats.tokens += sum(sum(m.response_tokens) for m in metas)
    return metas

  def _drop_idle_on_dead_nodes(self, every_s: float = 2.0) -> None:
    """An idle actor meets no failed call, so its node's death is looked for here."""
    idle = self._idle()
    if not idle or time.monotonic() - self._nodes_checked < every_s:
      return
    self._nodes_checked = time.monotonic()
    alive = {n.get("NodeID") for n in ray.nodes() if n.get("Alive")}
    for i in idle:
      if self._workers[i].node is not None and self._workers[i].node not in alive:
        self._drop(i, [], RuntimeError(f"node {self._workers[i].node} is dead"))

  def stats(self) -> RolloutStats:
    return dataclasses.replace(self._stats)

  def pids(self) -> dict[str, list[int]]:
    """Process ids of the working rollout actors and of the storage units (fault tests kill
    them), by unit id."""
    return {
      "rollout": [w.pid for _, w in sorted(self._workers.items()) if w.ready],
      "storage": [u.pid() for _, u in sorted(self._units.items())],
    }

  def close(self) -> None:
    for w in self._workers.values():
      ray.kill(w.actor, no_restart=True)
    for u in [*self._units.values(), *(u for _, u in self._closing)]:
      u.close()


_NODE_FATE_S = 90.0  # how long an unreachable actor's node is given to be marked dead or not


def _node_alive(node: str | None) -> bool:
  """Whether Ray still counts ``node`` among its live nodes (a node it marked dead, after its
  health checks failed, never comes back under the same id)."""
  if node is None:
    return True
  return any(n.get("NodeID") == node and n.get("Alive") for n in ray.nodes())
