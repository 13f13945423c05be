"""On-demand feed: order, prefetch overlap, errors, shutdown, exposed-latency arithmetic."""

import threading

import pytest

from knitjax.runtime.released import ReleasedQueue
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.feed import OnDemandFeed, Prepared, exposed_transfer


def _mbs(n, m=2):
  return [MiniBatch(i // m, i % m, ()) for i in range(n)]


def _list_take(items):
  it = iter(items)
  return lambda timeout: next(it, None)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_order_and_count(prefetch):
  mbs = _mbs(6)
  feed = OnDemandFeed(
    _list_take(mbs), lambda mb: (mb.index, {"x": 1.0}), count=6, prefetch=prefetch
  )
  got = list(feed)
  assert [p.minibatch for p in got] == mbs
  assert [p.batch for p in got] == [0, 1] * 3
  assert all(p.ready_at >= p.taken_at and p.fetch_s >= 0 for p in got)


def test_next_minibatch_is_prepared_while_the_current_one_trains():
  """With prefetch, mini-batch 1 is prepared before the trainer is done with mini-batch 0."""
  prepared = [threading.Event() for _ in range(3)]

  def prepare(mb):
    prepared[mb.index].set()
    return mb.index, {}

  feed = OnDemandFeed(_list_take(_mbs(3, m=3)), prepare, count=3, prefetch=1)
  first = next(feed)
  assert first.batch == 0
  # The "update" of mini-batch 0 has not finished (we hold it); the feed works ahead anyway.
  assert prepared[1].wait(5)
  assert [p.batch for p in feed] == [1, 2]


def test_without_prefetch_nothing_is_prepared_ahead():
  calls = []
  feed = OnDemandFeed(
    _list_take(_mbs(3, m=3)), lambda mb: (calls.append(mb.index), {}), count=3, prefetch=0
  )
  next(feed)
  assert calls == [0]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_errors_from_take_and_prepare_reach_the_trainer(prefetch):
  def bad_take(timeout):
    raise RuntimeError("the rollout thread failed: boom")

  with pytest.raises(RuntimeError, match="rollout thread failed"):
    next(OnDemandFeed(bad_take, lambda mb: (0, {}), count=1, prefetch=prefetch))

  def bad_prepare(mb):
    raise ValueError(f"group {mb.index} has no payload")

  feed = OnDemandFeed(_list_take(_mbs(2)), bad_prepare, count=2, prefetch=prefetch)
  with pytest.raises(ValueError, match="group 0 has no payload"):
    next(feed)


def test_close_stops_the_background_preparation_waiting_on_an_empty_queue():
  """After the last released mini-batch the prefetch thread polls the queue; close ends it."""
  queue = ReleasedQueue([MiniBatch(0, 0, ())])
  polls = []

  def take(timeout):
    polls.append(1)
    return queue.get(min(timeout, 0.05))

  feed = OnDemandFeed(take, lambda mb: (0, {}), count=5, prefetch=1)
  assert next(feed).minibatch.step == 0  # the prefetch thread now waits for the next one
  done = threading.Event()
  threading.Thread(target=lambda: (feed.close(), done.set()), daemon=True).start()
  assert done.wait(10)  # close() joins the thread: a blocked take returns within its poll
  n = len(polls)
  threading.Event().wait(0.3)
  assert len(polls) == n  # nothing polls any more


def test_released_queue_keeps_taken_minibatches_until_acknowledged():
  a, b, c = _mbs(3)
  q = ReleasedQueue([a])
  q.put(b)
  assert q.get(0) is a and q.get(0) is b and q.get(0) is None
  q.put(c)
  assert q.items() == [a, b, c] and len(q) == 3  # a checkpoint keeps the prefetched ones
  assert q.ack(a) > 0
  with pytest.raises(RuntimeError, match=r"\(1, 0\) acknowledged out of order"):
    q.ack(c)
  q.ack(b)
  assert q.items() == [c] and q.get(0) is c


def test_exposed_transfer_splits_the_wait():
  mb = MiniBatch(0, 0, ())
  # Released and taken at t=1; ready at t=4; the trainer asked at t=2 and got it at t=4.
  p = Prepared(mb, None, {}, taken_at=1.0, ready_at=4.0, fetch_s=3.0)
  assert exposed_transfer(p, 2.0, 4.0) == {
    "data_wait_s": 2.0,
    "exposed_fetch_s": 2.0,  # fetching from t=2 to t=4 was in the trainer's way
    "release_wait_s": 0.0,
    "fetch_s": 3.0,
  }
  # Prefetched: ready at t=4, the trainer asked at t=5: nothing exposed.
  assert exposed_transfer(p, 5.0, 5.0)["exposed_fetch_s"] == 0.0
  # Waited for release: asked at t=0, taken at t=1, ready at t=4.
  assert exposed_transfer(p, 0.0, 4.0) == {
    "data_wait_s": 4.0,
    "exposed_fetch_s": 3.0,
    "release_wait_s": 1.0,
    "fetch_s": 3.0,
  }
