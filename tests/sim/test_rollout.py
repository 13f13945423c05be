"""SlotPool: exact event times under continuous batching, occupancy slowdown and pauses."""

import math

import numpy as np
import pytest

from knitjax.sim.rollout import SlotPool


def _drain(pool):
  events = []
  while True:
    t, kind = pool.next_event()
    if kind < 0:
      return events
    if kind == 0:
      pool.pop_slot(t)
      events.append(("slot", t))
    else:
      events.append(("group", pool.pop_group(t), t))


def test_constant_iteration_time():
  pool = SlotPool(4, decode_s_per_token=1.0)
  pool.start(7, np.array([10.0, 20.0]))
  assert pool.free == 2 and pool.inflight_groups == 1
  assert _drain(pool) == [("slot", 10.0), ("slot", 20.0), ("group", 7, 20.0)]
  assert pool.busy_area == pytest.approx(10 * 2 + 10 * 1)
  assert pool.free == 4 and pool.inflight_groups == 0


def test_occupancy_slowdown_changes_rates_not_order():
  pool = SlotPool(4, decode_s_per_token=1.0, occupancy_slowdown=1.0)
  pool.start(0, np.array([10.0, 20.0]))
  ev = _drain(pool)
  # Two active: 1.5 s per iteration for 10 iterations; then one active: 1.25 s for 10 more.
  assert ev[0] == ("slot", pytest.approx(15.0))
  assert ev[2] == ("group", 0, pytest.approx(27.5))


def test_pause_stops_the_token_clock():
  pool = SlotPool(4, decode_s_per_token=1.0)
  pool.start(0, np.array([10.0]))
  pool.pause(5.0)
  pool.pause(1.0)  # queued after the first
  assert _drain(pool)[-1] == ("group", 0, pytest.approx(16.0))
  assert pool.pause_total == 6.0


def test_group_started_later_finishes_on_its_own_clock():
  pool = SlotPool(8, decode_s_per_token=0.5)
  pool.start(0, np.array([4.0, 4.0]))
  t, kind = pool.next_event()
  pool.advance(1.0)  # 2 iterations in
  pool.start(1, np.array([1.0]))
  ev = _drain(pool)
  assert ev[0] == ("slot", 1.5) and ev[1] == ("group", 1, 1.5)
  assert ev[-1] == ("group", 0, 2.0)
  assert pool.next_event() == (math.inf, -1)
