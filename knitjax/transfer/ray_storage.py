"""Storage units as Ray actors: the many-machine implementation of `StorageUnit`.

Each unit is a Ray actor holding an :class:`~knitjax.transfer.storage.InProcessStorageUnit`, placed
on the node of the rollout workers that write to it (``node_id``, a hard node affinity). Rollout
workers ``put`` to it and trainer consumers ``get`` from it straight through Ray's object store:
no controller relays payloads. The actor is threaded (``max_concurrency``), so a ``put`` blocked
by the byte budget (``on_full="block"``) waits inside the actor while ``release`` calls from the
trainer still run, exactly as in process.

Payloads travel as ``GroupPayload`` dataclasses (pickled by Ray, arrays out of band). Errors raised
in the actor (``PayloadError``, ``StorageFull``, ``KeyError``, ``ValueError``) reach the caller as
the same exception types, so the runtime handles both implementations alike.

Ray is optional (``pip install -e '.[ray]'``); importing this module without it fails with one
sentence saying so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from knitjax.transfer.payload import GroupPayload
from knitjax.transfer.storage import InProcessStorageUnit, StorageLimits, StorageUnit

try:
  import ray
  from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as e:  # pragma: no cover - exercised only without ray installed
  raise ImportError(
    "knitjax.transfer.ray_storage needs Ray: pip install -e '.[ray]' (or pip install ray)."
  ) from e


class _StorageActor:
  """The actor body: an in-process unit plus the node it runs on."""

  def __init__(self, limits: StorageLimits, unit_id: int):
    self._unit = InProcessStorageUnit(limits, unit_id=unit_id)

  def put(self, group_id, payload, images):
    return self._unit.put(group_id, payload, images)

  def get(self, group_ids):
    return self._unit.get(group_ids)

  def get_images(self, hashes):
    return self._unit.get_images(hashes)

  def release(self, group_ids):
    self._unit.release(group_ids)

  def stats(self):
    return self._unit.stats()

  def node_id(self) -> str:
    return ray.get_runtime_context().get_node_id()


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
  """

  def __init__(
    self,
    limits: StorageLimits,
    unit_id: int = 0,
    *,
    node_id: str | None = None,
    max_concurrency: int = 8,
  ):
    if not ray.is_initialized():
      raise RuntimeError(
        "RayStorageUnit needs a running Ray: call ray.init() (or set RAY_ADDRESS) first."
      )
    self.limits = limits
    self.unit_id = unit_id
    options: dict = {"num_cpus": 0, "max_concurrency": max_concurrency}
    if node_id is not None:
      options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    self._actor = ray.remote(_StorageActor).options(**options).remote(limits, unit_id)

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

  def stats(self) -> dict:
    return _result(self._actor.stats.remote())

  def close(self) -> None:
    """Ends the actor (its payloads are dropped)."""
    ray.kill(self._actor)
