"""On-demand access as a Grain pipeline: released mini-batches in, device-ready batches out.

One consumer's feed is a Grain ``IterDataset``: a source that takes released mini-batches in
(step, index) order (from the trainer's queue, or a step's list in colocated runs), a ``map``
that fetches this consumer's groups straight from their storage units and lays them out
(:func:`knitjax.transfer.access.fetch_minibatch` on the consumer's part of the plan, then the
transfer to the devices), and Grain's thread prefetch, so preparing the next mini-batch overlaps
the current update. Nothing is gathered centrally: each consumer reads only its own groups.

Timings per mini-batch (``Prepared``) let the trainer report exposed transfer latency
(docs/glossary.md): the part of the fetch it actually waited for, and the time from a mini-batch's
release to its compute.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grain
from grain.experimental import ThreadPrefetchIterDataset

from knitjax.transfer.admission import MiniBatch

POLL_S = 0.5  # seconds a feed waits on its source before checking for a stop


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A mini-batch ready for the trainer, with when and how long its preparation took."""

  minibatch: MiniBatch
  batch: Any  # whatever ``prepare`` returned (device arrays in the runtime)
  info: dict[str, float]
  taken_at: float  # perf_counter when the mini-batch left the queue
  ready_at: float  # perf_counter when its batch was ready
  fetch_s: float  # seconds spent fetching and laying out (host side)


class _ReleasedIterator(grain.DatasetIterator):
  """Takes ``count`` released mini-batches from ``take`` (which may block)."""

  def __init__(self, take: Callable[[float], MiniBatch | None], count: int, stop: threading.Event):
    super().__init__()
    self._take, self._count, self._stop = take, count, stop
    self._taken = 0

  def __next__(self) -> tuple[MiniBatch, float]:
    if self._taken >= self._count:
      raise StopIteration
    while not self._stop.is_set():
      mb = self._take(POLL_S)
      if mb is not None:
        self._taken += 1
        return mb, time.perf_counter()
    raise StopIteration

  def get_state(self) -> dict:
    # Not checkpointed through Grain: the queue of released, unconsumed mini-batches is part of
    # the run's checkpoint (knitjax.runtime.released), and a resumed feed starts from it.
    return {"taken": self._taken}

  def set_state(self, state: dict) -> None:
    self._taken = state["taken"]


class _Released(grain.IterDataset):
  def __init__(self, take, count: int, stop: threading.Event):
    super().__init__()
    self._take, self._count, self._stop = take, count, stop

  def __iter__(self) -> _ReleasedIterator:
    return _ReleasedIterator(self._take, self._count, self._stop)


class OnDemandFeed:
  """Iterates :class:`Prepared` mini-batches for one consumer, ``prefetch`` ahead.

  Args:
    take: ``take(timeout) -> MiniBatch | None``, the next released mini-batch (None: none yet).
      It may raise to stop the run (e.g. the rollout thread failed); the error reaches the
      trainer's ``next()``.
    prepare: ``prepare(minibatch) -> (batch, info)``: fetch from storage, lay out, transfer.
    count: how many mini-batches the trainer will consume.
    prefetch: mini-batches prepared ahead of the trainer in a background thread (0: prepare on
      demand in the trainer's thread). Grain's thread prefetch holds ``prefetch`` ready ones and
      may prepare one more while the buffer is full.
  """

  def __init__(
    self,
    take: Callable[[float], MiniBatch | None],
    prepare: Callable[[MiniBatch], tuple[Any, dict[str, float]]],
    *,
    count: int,
    prefetch: int = 1,
  ):
    if prefetch < 0:
      raise ValueError(f"prefetch must be >= 0 mini-batches, got {prefetch}.")
    self._stop = threading.Event()
    ds = _Released(take, count, self._stop).map(lambda item: self._prepare(prepare, *item))
    if prefetch:
      ds = ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
    self._it: Iterator[Prepared] = iter(ds)

  @staticmethod
  def _prepare(prepare, mb: MiniBatch, taken_at: float) -> Prepared:
    t = time.perf_counter()
    batch, info = prepare(mb)
    ready = time.perf_counter()
    return Prepared(mb, batch, info, taken_at, ready, ready - t)

  def __iter__(self) -> OnDemandFeed:
    return self

  def __next__(self) -> Prepared:
    return next(self._it)

  def close(self) -> None:
    """Stops the background preparation (a blocked ``take`` returns within its poll)."""
    self._stop.set()
    close = getattr(self._it, "close", None)
    if close is not None:
      close()


def exposed_transfer(prepared: Prepared, wanted_at: float, got_at: float) -> dict[str, float]:
  """Exposed transfer latency of one mini-batch, from the trainer's side.

  Args:
    prepared: what the feed returned.
    wanted_at: perf_counter when the trainer asked for the mini-batch.
    got_at: perf_counter when it had it.

  Returns:
    ``data_wait_s``: all the time the trainer waited; ``exposed_fetch_s``: the part of it spent
    fetching (preparation not hidden behind the previous update); ``release_wait_s``: the rest,
    waiting for rollout to release the mini-batch; ``fetch_s``: the preparation time, hidden or not.
  """
  wait = max(0.0, got_at - wanted_at)
  exposed = min(wait, max(0.0, prepared.ready_at - max(wanted_at, prepared.taken_at)))
  return {
    "data_wait_s": wait,
    "exposed_fetch_s": exposed,
    "release_wait_s": wait - exposed,
    "fetch_s": prepared.fetch_s,
  }
