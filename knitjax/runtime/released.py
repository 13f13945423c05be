"""Released mini-batches on their way from the admission index to the trainer.

The rollout thread appends what the index releases (always in (step, index) order); the trainer
takes them in that order. The queue can be read whole for a checkpoint.
"""

from __future__ import annotations

import collections
import threading

from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.group import GroupMeta


class ReleasedQueue:
  """FIFO of released mini-batches, thread-safe."""

  def __init__(self, items=()):
    self._cond = threading.Condition()
    self._items: collections.deque[MiniBatch] = collections.deque(items)

  def __len__(self) -> int:
    with self._cond:
      return len(self._items)

  def put(self, minibatch: MiniBatch) -> None:
    with self._cond:
      self._items.append(minibatch)
      self._cond.notify_all()

  def get(self, timeout: float) -> MiniBatch | None:
    """The oldest mini-batch, waiting up to ``timeout`` seconds; None if none came."""
    with self._cond:
      if not self._cond.wait_for(lambda: bool(self._items), timeout):
        return None
      return self._items.popleft()

  def items(self) -> list[MiniBatch]:
    with self._cond:
      return list(self._items)


def minibatch_to_dict(mb: MiniBatch) -> dict:
  return {"step": mb.step, "index": mb.index, "groups": [g.to_dict() for g in mb.groups]}


def minibatch_from_dict(d: dict) -> MiniBatch:
  return MiniBatch(d["step"], d["index"], tuple(GroupMeta.from_dict(g) for g in d["groups"]))
