"""Storage units as Ray actors: the many-machine implementation of `StorageUnit`.

Each unit is a Ray actor holding an :class:`~knitjax.transfer.storage.InProcessStorageUnit`, placed
on the node of the rollout workers that write to it (``node_id``, a hard node affinity). Rollout
workers ``put`` to it and trainer consumers ``get`` from it straight through Ray's object store:
no controller relays payloads. The actor is threaded (``max_concurrency``), so a ``put`` blocked
by the byte budget (``on_full="block"``) waits inside the actor while ``release`` calls from the
trainer still run, exactly as in process.

A unit survives the death of its actor process when built with ``max_restarts > 0``: each stored
group is also written to a node-local spill folder (``<tmp>/knitjax-storage-<random token>``, its
own per unit and run, owner-only: the folder 0700, its files 0600; a file is removed on release,
the folder on ``close``), Ray restarts the actor, the new actor replays the folder into memory,
and the calls that were in flight are retried (``max_task_retries``), so a ``put``, ``get`` or
``release`` that met the dead actor completes on the restarted one. ``stats()["restarts"]``
counts restarts. Losing the whole node loses its units' payloads (not survived).

Payloads travel as ``GroupPayload`` dataclasses (pickled by Ray, arrays out of band). Errors raised
in the actor (``PayloadError``, ``StorageFull``, ``KeyError``, ``ValueError``) reach the caller as
the same exception types, so the runtime handles both implementations alike.

Ray is optional (``pip install -e '.[ray]'``); importing this module without it fails with one
sentence saying so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Mapping, Sequence

import numpy as np

from knitjax.transfer.payload import GroupPayload
from knitjax.transfer.storage import InProcessStorageUnit, StorageLimits, StorageUnit

try:
  import ray
  from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as e:  # pragma: no cover - exercised only without ray installed
  raise ImportError(
    "knitjax.distributed.ray_storage needs Ray: pip install -e '.[ray]' (or pip install ray)."
  ) from e


NAMESPACE = "knitjax"  # named actors (units a trainer process connects to) live here


class _StorageActor:
  """The actor body: an in-process unit, the node it runs on, and the optional spill folder."""

  def __init__(self, limits: StorageLimits, unit_id: int, spill_token: str | None = None):
    self._unit = InProcessStorageUnit(limits, unit_id=unit_id)
    self._dir, self._restarts, self._replayed = None, 0, set()
    if spill_token is not None:
      self._dir = spill_folder(spill_token)
      marker = os.path.join(self._dir, "restarts")
      if os.path.exists(marker):  # a restart of this unit: replay what the old actor held
        with open(marker) as f:
          self._restarts = int(f.read() or 0) + 1
      _write_atomic(marker, str(self._restarts).encode())
      self._replay()

  def _file(self, group_id: int) -> str:
    return os.path.join(self._dir, f"{group_id}.npz")

  def _replay(self) -> None:
    for name in sorted(os.listdir(self._dir)):
      if not name.endswith(".npz") or not name[:-4].isdigit():
        continue  # the marker, or a spill file torn by the crash (written under a temp name)
      with np.load(os.path.join(self._dir, name)) as z:
        arrays = {k: z[k] for k in z.files}
      count = sum(k.startswith("image_") for k in arrays)
      images = [arrays.pop(f"image_{k}") for k in range(count)]
      gid = int(name[:-4])
      self._unit.put(gid, GroupPayload.from_arrays(arrays), images)
      self._replayed.add(gid)

  def put(self, group_id, payload, images):
    if group_id in self._replayed:  # a put retried after a restart: the replayed copy gives way
      self._unit.release([group_id])
      self._replayed.discard(group_id)
    n = self._unit.put(group_id, payload, images)
    if self._dir is not None:
      (stored,) = self._unit.get([group_id])
      arrays = {**stored.to_arrays(), **{f"image_{k}": im for k, im in enumerate(images)}}
      path = self._file(group_id)
      with _private_file(path + ".tmp") as f:
        np.savez(f, **arrays)
      os.replace(path + ".tmp", path)
    return n

  def get(self, group_ids):
    return self._unit.get(group_ids)

  def get_images(self, hashes):
    return self._unit.get_images(hashes)

  def release(self, group_ids):
    self._unit.release(group_ids)
    self._unspill(group_ids)

  def _unspill(self, group_ids) -> None:
    self._replayed.difference_update(group_ids)
    if self._dir is not None:
      for g in group_ids:
        with contextlib.suppress(FileNotFoundError):
          os.remove(self._file(g))

  def stats(self):
    return {**self._unit.stats(), "restarts": self._restarts}

  def destroy(self) -> None:
    if self._dir is not None:
      shutil.rmtree(self._dir, ignore_errors=True)

  def pid(self) -> int:
    return os.getpid()

  def node_id(self) -> str:
    return ray.get_runtime_context().get_node_id()


def spill_folder(token: str) -> str:
  """The spill folder of the unit whose (random, per run) token is ``token``: made owner-only
  (0700) on the unit's first start, reused by its restarts only while it is still this user's
  and owner-only (the temp folder is shared with every user of the node)."""
  path = os.path.join(tempfile.gettempdir(), f"knitjax-storage-{token}")
  with contextlib.suppress(FileExistsError):
    os.mkdir(path, 0o700)
  st = os.lstat(path)
  if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
    raise PermissionError(
      f"the storage spill folder {path} is not an owner-only folder of this user; remove it."
    )
  return path


def _private_file(path: str):
  """``path`` opened for writing, owner-only (0600) from its creation."""
  return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")


def _write_atomic(path: str, data: bytes) -> None:
  with _private_file(path + ".tmp") as f:
    f.write(data)
  os.replace(path + ".tmp", path)


def _result(ref):
  """``ray.get`` that re-raises an actor's exception as its own type."""
  try:
    return ray.get(ref)
  except ray.exceptions.RayTaskError as e:
    cause = getattr(e, "cause", None)
    if isinstance(cause, Exception):
      raise cause from None
    raise


class RayStorageUnit(StorageUnit):
  """A storage unit living in a Ray actor; same interface and errors as the in-process one.

  Args:
    limits: validation bounds and byte budget (as for the in-process unit).
    unit_id: the unit's id (``GroupMeta.storage_unit``).
    node_id: Ray node to place the actor on (the rollout host); None lets Ray choose.
    max_concurrency: actor threads, so blocked puts do not block releases and gets.
    max_restarts: times Ray restarts a dead actor (0: a death loses the unit); > 0 also spills
      each stored group to node-local disk so the restarted actor holds the same groups.
    name: a Ray actor name, so another driver of the cluster (a trainer process) reaches the
      unit with :meth:`connect`; None: unnamed.
  """

  def __init__(
    self,
    limits: StorageLimits,
    unit_id: int = 0,
    *,
    node_id: str | None = None,
    max_concurrency: int = 8,
    max_restarts: int = 0,
    name: str | None = None,
  ):
    if not ray.is_initialized():
      raise RuntimeError(
        "RayStorageUnit needs a running Ray: call ray.init() (or set RAY_ADDRESS) first."
      )
    self.limits = limits
    self.unit_id = unit_id
    options: dict = {"num_cpus": 0, "max_concurrency": max_concurrency}
    if name is not None:
      options.update(name=name, namespace=NAMESPACE)
    if node_id is not None:
      options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    token = None
    if max_restarts > 0:
      options.update(max_restarts=max_restarts, max_task_retries=max_restarts)
      token = f"{uuid.uuid4().hex}-unit-{unit_id}"
    self._actor = ray.remote(_StorageActor).options(**options).remote(limits, unit_id, token)

  @classmethod
  def connect(cls, name: str, limits: StorageLimits, unit_id: int) -> RayStorageUnit:
    """The unit another driver created under ``name`` (reads and releases; not closed here).

    Raises:
      ValueError: no actor of that name is alive in the cluster (one sentence).
    """
    try:
      actor = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
      raise ValueError(
        f"storage unit {unit_id} ({name!r}) is not alive in the Ray cluster this process joined."
      ) from None
    unit = cls.__new__(cls)
    unit.limits, unit.unit_id, unit._actor = limits, unit_id, actor
    return unit

  @property
  def node_id(self) -> str:
    """The Ray node the unit runs on."""
    return _result(self._actor.node_id.remote())

  def put(
    self,
    group_id: int,
    payload: Mapping[str, np.ndarray] | GroupPayload,
    images: Sequence[np.ndarray] = (),
  ) -> int:
    if not isinstance(payload, GroupPayload) and isinstance(payload, Mapping):
      payload = dict(payload)  # a plain dict pickles; other mappings may not
    return _result(self._actor.put.remote(group_id, payload, list(images)))

  def get(self, group_ids: Sequence[int]) -> list[GroupPayload]:
    return _result(self._actor.get.remote(list(group_ids)))

  def get_images(self, hashes: Sequence[str]) -> list[np.ndarray]:
    return _result(self._actor.get_images.remote(list(hashes)))

  def release(self, group_ids: Sequence[int]) -> None:
    _result(self._actor.release.remote(list(group_ids)))

  def pid(self) -> int:
    """The actor's process id (fault tests kill it)."""
    return _result(self._actor.pid.remote())

  def stats(self) -> dict:
    return _result(self._actor.stats.remote())

  def close(self) -> None:
    """Ends the actor (its payloads and spill folder are dropped); a second call does nothing."""
    if self._actor is None:
      return
    actor, self._actor = self._actor, None
    with contextlib.suppress(ray.exceptions.RayActorError):  # dead: nothing to clean
      _result(actor.destroy.remote())
    ray.kill(actor, no_restart=True)
