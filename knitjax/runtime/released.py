"""Released mini-batches on their way from the admission index to the trainer.

The rollout thread appends what the index releases (always in (step, index) order); the
trainer's feed takes them in that order (possibly ahead of the update, to prefetch) and
acknowledges each once its update is applied. Until then a taken mini-batch stays in the queue,
so a checkpoint (`items`) holds every released mini-batch not yet consumed, prefetched or not.

A mini-batch whose groups were lost with their storage unit is reopened in the admission index
and here (`reopen`): its place in the order stays, but it is taken by no one until the index
releases it again, refilled (`refill`). The trainer claims a mini-batch (`claim`) once it holds
its fetched batch; a claimed mini-batch is consumed as fetched and is never reopened.
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
    self._claimed = False  # items[0] is being consumed (its batch fetched)
    self._reopened: set[tuple[int, int]] = set()  # (step, index) waiting to be refilled

  def __len__(self) -> int:
    """Released mini-batches not consumed yet (taken or not)."""
    with self._cond:
      return len(self._items)

  def put(self, minibatch: MiniBatch) -> None:
    with self._cond:
      self._items.append((minibatch, time.perf_counter()))
      self._cond.notify_all()

  def get(self, timeout: float) -> MiniBatch | None:
    """Takes the oldest untaken mini-batch, waiting up to ``timeout`` s; None if none came (or
    the next one is reopened)."""
    with self._cond:
      if not self._cond.wait_for(lambda: self._takeable(self._taken), timeout):
        return None
      self._taken += 1
      return self._items[self._taken - 1][0]

  def _takeable(self, k: int) -> bool:
    return len(self._items) > k and _key(self._items[k][0]) not in self._reopened

  def reopen(self, minibatch: MiniBatch) -> bool:
    """Marks ``minibatch`` (queued, not claimed) as waiting to be refilled; False if it is not
    queued or already claimed (then it is consumed as fetched)."""
    with self._cond:
      k = self._position(minibatch)
      if k is None or (k == 0 and self._claimed):
        return False
      self._reopened.add(_key(minibatch))
      return True

  def refill(self, minibatch: MiniBatch) -> None:
    """Puts the refilled mini-batch in its reopened one's place."""
    with self._cond:
      key = _key(minibatch)
      k = next(i for i, (mb, _) in enumerate(self._items) if _key(mb) == key)
      self._items[k] = (minibatch, self._items[k][1])
      self._reopened.discard(key)
      self._cond.notify_all()

  def claim(self, minibatch: MiniBatch, timeout: float) -> MiniBatch | None:
    """The trainer is about to consume the oldest mini-batch, fetched as ``minibatch``: returns
    ``minibatch`` (now claimed), or the refilled mini-batch to fetch again if it was reopened
    (waiting up to ``timeout`` s for it; None if it did not come)."""
    with self._cond:
      if not self._items or _key(self._items[0][0]) != _key(minibatch):
        raise RuntimeError(f"mini-batch {_key(minibatch)} claimed out of order.")
      if self._items[0][0] is minibatch and _key(minibatch) not in self._reopened:
        self._claimed = True
        return minibatch
      if not self._cond.wait_for(lambda: _key(minibatch) not in self._reopened, timeout):
        return None
      return self._items[0][0]

  def reopened(self, minibatch: MiniBatch) -> bool:
    """Whether ``minibatch`` was reopened: waiting to be refilled, or refilled (its place holds
    another mini-batch of the same step and index)."""
    key = _key(minibatch)
    with self._cond:
      return key in self._reopened or any(
        _key(mb) == key and mb is not minibatch for mb, _ in self._items
      )

  def _position(self, minibatch: MiniBatch) -> int | None:
    return next((i for i, (mb, _) in enumerate(self._items) if mb is minibatch), None)

  def ack(self, minibatch: MiniBatch) -> float:
    """Marks the oldest taken mini-batch consumed; returns when it was released (perf_counter)."""
    with self._cond:
      if not self._taken or self._items[0][0] is not minibatch:
        raise RuntimeError(
          f"mini-batch {(minibatch.step, minibatch.index)} acknowledged out of order."
        )
      self._taken -= 1
      self._claimed = False
      return self._items.popleft()[1]

  def items(self, *, whole: bool = False) -> list[MiniBatch]:
    """Every released mini-batch not consumed yet, oldest first (what a checkpoint keeps);
    ``whole``: without the reopened ones (their groups are the admission index's)."""
    with self._cond:
      return [mb for mb, _ in self._items if not (whole and _key(mb) in self._reopened)]


def _key(minibatch: MiniBatch) -> tuple[int, int]:
  return minibatch.step, minibatch.index
