"""Released mini-batches on their way from the admission index to the trainer.

The rollout thread appends what the index releases (always in (step, index) order); the
trainer's feed takes them in that order (possibly ahead of the update, to prefetch) and
acknowledges each once its update is applied. Until then a taken mini-batch stays in the queue,
so a checkpoint (`items`) holds every released mini-batch not yet consumed, prefetched or not.
"""

from __future__ import annotations

import collections
import threading
import time

from knitjax.transfer.admission import MiniBatch


class ReleasedQueue:
  """FIFO of released, unconsumed mini-batches with a take cursor; thread-safe."""

  def __init__(self, items=()):
    self._cond = threading.Condition()
    now = time.perf_counter()
    self._items: collections.deque[tuple[MiniBatch, float]] = collections.deque(
      (mb, now) for mb in items
    )
    self._taken = 0  # items[:taken] were taken and are not acknowledged yet

  def __len__(self) -> int:
    """Released mini-batches not consumed yet (taken or not)."""
    with self._cond:
      return len(self._items)

  def put(self, minibatch: MiniBatch) -> None:
    with self._cond:
      self._items.append((minibatch, time.perf_counter()))
      self._cond.notify_all()

  def get(self, timeout: float) -> MiniBatch | None:
    """Takes the oldest untaken mini-batch, waiting up to ``timeout`` s; None if none came."""
    with self._cond:
      if not self._cond.wait_for(lambda: len(self._items) > self._taken, timeout):
        return None
      self._taken += 1
      return self._items[self._taken - 1][0]

  def ack(self, minibatch: MiniBatch) -> float:
    """Marks the oldest taken mini-batch consumed; returns when it was released (perf_counter)."""
    with self._cond:
      if not self._taken or self._items[0][0] is not minibatch:
        raise RuntimeError(
          f"mini-batch {(minibatch.step, minibatch.index)} acknowledged out of order."
        )
      self._taken -= 1
      return self._items.popleft()[1]

  def items(self) -> list[MiniBatch]:
    """Every released mini-batch not consumed yet, oldest first (what a checkpoint keeps)."""
    with self._cond:
      return [mb for mb, _ in self._items]
