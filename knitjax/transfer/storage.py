"""Storage unit: the host-side store of trajectory payloads, with a byte budget.

Rollout workers ``put`` each complete group's payload (schema in ``knitjax.transfer.payload``)
once; consumers ``get`` the ``GroupPayload``s of the groups assigned to them; the runtime
``release``s groups
after their mini-batch is consumed. Images are stored once per content hash (``image_hash``) with
a reference count per group that uses them, and freed with the last such group.

Memory is bounded by ``StorageLimits.max_bytes`` (stored arrays plus unique images): a ``put`` that
does not fit either waits for releases (``on_full="block"``, up to ``timeout_s``) or fails at once
(``"raise"``), both ending in ``StorageFull``. Waiting writers are served first come, first served,
so a large group is not starved by a stream of small ones.

``StorageUnit`` is the interface; ``InProcessStorageUnit`` is the embedded implementation (a Ray
actor implements the same interface on many machines).
"""

import abc
import collections
import dataclasses
import hashlib
import itertools
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from knitjax.transfer.payload import GroupPayload
from knitjax.transfer.validation import (
  REJECT_REASONS,
  PayloadError,
  validate_image,
  validate_payload,
)

__all__ = [
  "GroupPayload",
  "InProcessStorageUnit",
  "PayloadError",
  "StorageFull",
  "StorageLimits",
  "StorageUnit",
  "image_hash",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StorageLimits:
  """Validation bounds and the byte budget of one storage unit.

  Attributes:
    vocab_size: token ids must lie in ``[0, vocab_size)``.
    max_seq_len: bound on prompt + response tokens of one sample.
    max_bytes: budget for stored arrays plus unique images.
    max_image_bytes: bound on one image.
    on_full: ``"block"`` (wait up to ``timeout_s`` for releases) or ``"raise"``.
    timeout_s: how long a blocked ``put`` waits before raising ``StorageFull``.
  """

  vocab_size: int
  max_seq_len: int
  max_bytes: int
  max_image_bytes: int = 16 << 20
  on_full: str = "block"
  timeout_s: float = 30.0

  def __post_init__(self):
    for name in ("vocab_size", "max_seq_len", "max_bytes", "max_image_bytes"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"StorageLimits.{name} is {value!r}; accepted: a positive int.")
    if self.on_full not in ("block", "raise"):
      raise ValueError(f"StorageLimits.on_full is {self.on_full!r}; accepted: 'block' or 'raise'.")
    if not (isinstance(self.timeout_s, int | float) and 0 <= self.timeout_s < float("inf")):
      raise ValueError(f"StorageLimits.timeout_s is {self.timeout_s!r}; accepted: finite and >= 0.")

  @classmethod
  def for_steps(
    cls,
    *,
    vocab_size: int,
    max_seq_len: int,
    groups_per_step: int,
    group_size: int,
    image_bytes: int = 0,
    steps: int = 8,
  ) -> "StorageLimits":
    """Room for ``steps`` train steps of payload (at least 16 MiB).

    A token costs at most 16 bytes across the stored arrays (tokens, mask, log-probs, reference
    log-probs); ``image_bytes`` is one group's images, counted once per group (no dedup credit).
    """
    step_bytes = groups_per_step * (group_size * max_seq_len * 16 + image_bytes)
    return cls(
      vocab_size=vocab_size,
      max_seq_len=max_seq_len,
      max_bytes=int(max(steps * step_bytes, 1 << 24)),
    )


class StorageFull(RuntimeError):
  """A ``put`` did not fit in the byte budget (at once, or within ``timeout_s``)."""


def image_hash(image: np.ndarray) -> str:
  """Content hash of an image: sha256 hex digest over its dtype, shape and bytes."""
  h = hashlib.sha256()
  h.update(f"{image.dtype.str}|{','.join(map(str, image.shape))}|".encode())
  h.update(np.ascontiguousarray(image).data)
  return h.hexdigest()


def release_groups(storage: Mapping[int, "StorageUnit"], groups: Sequence) -> None:
  """Releases consumed (or rejected) groups (``GroupMeta``s) in the units that hold them."""
  by_unit: dict[int, list[int]] = {}
  for g in groups:
    by_unit.setdefault(g.storage_unit, []).append(g.group_id)
  for unit, ids in by_unit.items():
    storage[unit].release(ids)


class StorageUnit(abc.ABC):
  """Interface of a storage unit (in-process here, a Ray actor on many machines)."""

  unit_id: int

  @abc.abstractmethod
  def put(
    self,
    group_id: int,
    payload: Mapping[str, np.ndarray] | GroupPayload,
    images: Sequence[np.ndarray] = (),
  ) -> int:
    """Validates and stores one group's payload and images.

    Args:
      group_id: unique among the groups held.
      payload: field -> array, per ``knitjax.transfer.payload``, or a ``GroupPayload``.
      images: the group's images; ``image_index`` indexes into them.

    Returns:
      Bytes newly stored (payload plus images not already held).

    Raises:
      PayloadError: the payload is bad (nothing is stored; counted in ``stats()["rejected"]``).
      StorageFull: the group did not fit in the budget in time.
    """

  @abc.abstractmethod
  def get(self, group_ids: Sequence[int]) -> list[GroupPayload]:
    """Returns the stored payload of each group, in the given order.

    Group boundaries are kept because advantages are per group. Arrays are read-only; copy
    before changing them.

    Raises:
      KeyError: a group is not held (the message names it).
    """

  @abc.abstractmethod
  def get_images(self, hashes: Sequence[str]) -> list[np.ndarray]:
    """Returns the images with these content hashes (read-only). Raises KeyError if absent."""

  @abc.abstractmethod
  def release(self, group_ids: Sequence[int]) -> None:
    """Drops the groups held and wakes blocked writers.

    Ids not held (never put, already released, lost with a crashed rollout actor) are skipped
    and counted in ``stats()["release_misses"]``: releasing is idempotent, so a caller that
    cannot know whether a group reached the unit may release it anyway.
    """

  @abc.abstractmethod
  def stats(self) -> dict:
    """Gauges and counters: groups, bytes, images, image_refs, rejected (per reason), puts, gets,
    releases, release_misses (ids released but not held), full (StorageFull raised), waiting,
    blocked_puts, blocked_s, ..."""

  def close(self) -> None:  # noqa: B027 - most units hold nothing beyond their memory
    """Releases what the unit holds outside its process (a Ray actor, its spill folder)."""


@dataclasses.dataclass(frozen=True)
class _Group:
  payload: GroupPayload
  image_hashes: tuple[str, ...]  # unique, in first-use order
  nbytes: int  # payload only; images are counted once in the unit


class InProcessStorageUnit(StorageUnit):
  """Thread-safe in-process storage unit (one ``threading.Condition`` guards its state)."""

  def __init__(self, limits: StorageLimits, unit_id: int = 0):
    self.limits = limits
    self.unit_id = unit_id
    self._cond = threading.Condition()
    self._groups: dict[int, _Group] = {}
    self._images: dict[str, np.ndarray] = {}
    self._refs: dict[str, int] = {}
    self._bytes = 0
    self._reserved: set[int] = set()  # ids of puts waiting for room
    self._queue: collections.deque[int] = collections.deque()  # FIFO tickets of waiting puts
    self._tickets = itertools.count()
    self._rejected = dict.fromkeys(REJECT_REASONS, 0)
    self._counts = collections.Counter()
    self._blocked_s = 0.0

  def _reject(self, err: PayloadError) -> PayloadError:
    with self._cond:
      self._rejected[err.reason] += 1
    return err

  def put(
    self,
    group_id: int,
    payload: Mapping[str, np.ndarray] | GroupPayload,
    images: Sequence[np.ndarray] = (),
  ) -> int:
    if isinstance(group_id, bool) or not isinstance(group_id, int | np.integer):
      raise self._reject(
        PayloadError(group_id, "group_id", "dtype", "is not an int; accepted: an int.")
      )
    gid = int(group_id)
    lim = self.limits
    # Validation and hashing run outside the lock: they touch no shared state.
    try:
      stored = validate_payload(
        gid, payload, len(images), vocab_size=lim.vocab_size, max_seq_len=lim.max_seq_len
      )
      checked = [
        validate_image(gid, k, im, max_image_bytes=lim.max_image_bytes)
        for k, im in enumerate(images)
      ]
    except PayloadError as err:
      raise self._reject(err) from None
    unique = dict(zip((image_hash(im) for im in checked), checked, strict=True))
    payload_bytes = stored.nbytes
    full_bytes = payload_bytes + sum(im.nbytes for im in unique.values())
    if full_bytes > lim.max_bytes:
      raise self._reject(
        PayloadError(
          gid,
          "payload",
          "too_large",
          f"and images take {full_bytes} bytes; accepted: at most max_bytes {lim.max_bytes}.",
        )
      )

    with self._cond:
      if gid in self._groups or gid in self._reserved:
        self._rejected["duplicate"] += 1
        raise PayloadError(
          gid,
          "group_id",
          "duplicate",
          f"is already held by storage unit {self.unit_id}; accepted: an id not held.",
        )
      ticket = next(self._tickets)
      self._queue.append(ticket)
      self._reserved.add(gid)
      start, waited = time.monotonic(), False
      try:
        while True:
          need = payload_bytes + sum(im.nbytes for h, im in unique.items() if h not in self._images)
          if self._queue[0] == ticket and self._bytes + need <= lim.max_bytes:
            break
          left = start + lim.timeout_s - time.monotonic()
          if lim.on_full == "raise" or left <= 0:
            self._counts["full"] += 1
            raise StorageFull(
              f"storage unit {self.unit_id} is full: group {gid} needs {need} bytes and "
              f"{lim.max_bytes - self._bytes} of max_bytes {lim.max_bytes} are free"
              f"{f' after waiting {lim.timeout_s} s' if lim.on_full == 'block' else ''}; "
              "release consumed groups sooner or raise max_bytes."
            )
          waited = True
          self._cond.wait(left)
        for h, im in unique.items():
          if h in self._images:
            self._counts["image_dedup_hits"] += 1
          else:
            self._images[h] = im
          self._refs[h] = self._refs.get(h, 0) + 1
        self._groups[gid] = _Group(stored, tuple(unique), payload_bytes)
        self._bytes += need
        self._counts["puts"] += 1
        return need
      finally:
        if waited:
          self._blocked_s += time.monotonic() - start
          self._counts["blocked_puts"] += 1
        self._queue.remove(ticket)
        self._reserved.discard(gid)
        self._cond.notify_all()

  def get(self, group_ids: Sequence[int]) -> list[GroupPayload]:
    with self._cond:
      missing = [g for g in group_ids if g not in self._groups]
      if missing:
        raise KeyError(
          f"groups {missing} are not held by storage unit {self.unit_id} "
          "(never put, or already released)."
        )
      self._counts["gets"] += 1
      return [self._groups[g].payload for g in group_ids]

  def get_images(self, hashes: Sequence[str]) -> list[np.ndarray]:
    with self._cond:
      missing = [h for h in hashes if h not in self._images]
      if missing:
        raise KeyError(f"images {missing} are not held by storage unit {self.unit_id}.")
      return [self._images[h] for h in hashes]

  def release(self, group_ids: Sequence[int]) -> None:
    with self._cond:
      dropped = misses = 0
      for g in group_ids:
        group = self._groups.pop(g, None)
        if group is None:
          misses += 1
          continue
        dropped += 1
        self._bytes -= group.nbytes
        for h in group.image_hashes:
          self._refs[h] -= 1
          if self._refs[h] == 0:
            del self._refs[h]
            self._bytes -= self._images.pop(h).nbytes
      self._counts["releases"] += dropped
      self._counts["release_misses"] += misses
      if dropped:
        self._cond.notify_all()

  def stats(self) -> dict:
    with self._cond:
      return {
        "unit_id": self.unit_id,
        "groups": len(self._groups),
        "bytes": self._bytes,
        "max_bytes": self.limits.max_bytes,
        "images": len(self._images),
        "image_bytes": sum(im.nbytes for im in self._images.values()),
        "image_refs": sum(self._refs.values()),
        "image_dedup_hits": self._counts["image_dedup_hits"],
        "rejected": dict(self._rejected),
        "puts": self._counts["puts"],
        "gets": self._counts["gets"],
        "releases": self._counts["releases"],
        "release_misses": self._counts["release_misses"],
        "full": self._counts["full"],
        "waiting": len(self._queue),
        "blocked_puts": self._counts["blocked_puts"],
        "blocked_s": self._blocked_s,
      }
