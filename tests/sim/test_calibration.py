"""The group-start stall measured from the engine's call timeline, with and without host work
overlapping the calls (`knitjax.sim.calibration.engine_timeline_fit`)."""

import numpy as np
import pytest

from knitjax.sim.calibration import (
  engine_timeline_fit,
  overlap_fraction,
  rollout_busy_intervals,
  trainer_contention,
)

A, B, E = 0.001, 0.002, 0.005  # a call: 1 ms + 2 ms per decode pass + 5 ms per chunk pass


def _timeline(host_s, *, overlap, n=40, seed=0):
  """Rows of `ContinuousEngine.timeline` for calls of known device time, ``host_s`` of host work
  per call; without overlap the host works after collecting, with it while the next call runs."""
  rng = np.random.default_rng(seed)
  rows, t, device_free = [], 0.0, 0.0
  for _ in range(n):
    decode, chunks = int(rng.integers(1, 9)), int(rng.integers(0, 3))
    launch = t
    device_end = max(launch, device_free) + A + B * decode + E * chunks
    if overlap:  # host work runs beside the call, then the host collects it
      begin = launch + host_s
      end = max(begin, device_end)
      t = end  # the next launch follows the collect at once
    else:  # the host collects at once, then works
      begin = launch
      end = device_end
      t = end + host_s
    device_free = device_end
    rows.append((launch, begin, end, float(begin < device_end), decode, decode, chunks, 8, 1))
  return np.asarray(rows)


def test_without_overlap_the_host_gaps_are_the_stall_beside_the_calls_own_costs():
  rows = _timeline(0.004, overlap=False)
  fit = engine_timeline_fit(rows, groups_started=40)
  assert fit["decode_s_per_iteration"] == pytest.approx(B, rel=1e-6)
  assert fit["calls_running_at_collect"] == 1.0
  assert fit["host_gap_s"] == pytest.approx(0.004 * 39, rel=1e-6)
  beyond = A * 40 + E * rows[:, 6].sum()
  assert fit["group_start_s"] == pytest.approx((0.004 * 39 + beyond) / 40, rel=1e-6)
  busy = (rows[:, 2] - rows[:, 0]).sum() + 0.004 * 39
  assert fit["group_start_stall_fraction"] == pytest.approx((0.004 * 39 + beyond) / busy)


def test_host_work_shorter_than_a_call_overlaps_it_and_leaves_no_gap():
  fit = engine_timeline_fit(_timeline(0.0005, overlap=True), groups_started=40)
  assert fit["host_gap_s"] == pytest.approx(0.0, abs=1e-9)
  assert fit["decode_s_per_iteration"] == pytest.approx(B, rel=1e-6)
  slow = engine_timeline_fit(_timeline(0.0005, overlap=False), groups_started=40)
  assert fit["group_start_stall_fraction"] < slow["group_start_stall_fraction"]


def test_calls_the_host_came_late_for_use_the_fitted_device_time():
  # Host work of 9 ms: longer than every call with <= 3 decode passes and no chunk.
  rows = _timeline(0.009, overlap=True)
  late = rows[:, 3] == 0
  assert late.any() and (~late).sum() >= 3
  fit = engine_timeline_fit(rows, groups_started=40)
  device = A + B * rows[:, 5] + E * rows[:, 6]
  assert fit["device_s"] == pytest.approx(device.sum(), rel=1e-6)
  gaps = rows[1:, 0] - (rows[:-1, 0] + device[:-1])
  assert fit["host_gap_s"] == pytest.approx(np.maximum(gaps, 0).sum(), rel=1e-6)


def test_too_few_calls_seen_running_give_no_fit():
  rows = _timeline(1.0, overlap=True, n=5)
  assert rows[:, 3].sum() < 3
  assert engine_timeline_fit(rows, groups_started=5) is None


def test_call_times_that_do_not_grow_with_decode_passes_give_device_seconds_per_pass():
  rows = _timeline(0.0, overlap=False)
  took = 0.01 - 0.0001 * rows[:, 5]  # longer calls with fewer passes, one after the other
  rows[:, 0] = rows[:, 1] = np.concatenate([[0.0], np.cumsum(took)[:-1]])
  rows[:, 2] = rows[:, 0] + took
  fit = engine_timeline_fit(rows, groups_started=40)
  assert fit["decode_split"] == "ratio"
  want = (rows[:, 2] - rows[:, 0]).sum() / rows[:, 5].sum()
  assert fit["decode_s_per_iteration"] == pytest.approx(want)
  assert fit["group_start_stall_fraction"] >= 0


def test_the_report_delay_is_half_a_call_after_its_launch_plus_the_wait_for_collect():
  """A sample ends on average half-way through its call's device time and is handed back at
  collect end: the delay is the mean of ``collect end - launch - device / 2``."""
  rows = _timeline(0.009, overlap=True)  # some calls collected late, after host work
  fit = engine_timeline_fit(rows, groups_started=40)
  device = A + B * rows[:, 5] + E * rows[:, 6]
  want = np.mean(rows[:, 2] - rows[:, 0] - device / 2)
  assert fit["report_delay_s"] == pytest.approx(want, rel=1e-3)
  assert fit["report_delay_s"] > np.mean(device) / 2  # the host's lateness adds to it


def test_overlap_is_the_covered_fraction_of_each_window():
  iv = np.array([[1.0, 2.0], [3.0, 3.5]])
  w = np.array([[0.0, 1.0], [1.5, 3.5], [1.0, 2.0], [5.0, 6.0]])
  np.testing.assert_allclose(overlap_fraction(w, iv), [0.0, 0.5, 1.0, 0.0])
  np.testing.assert_allclose(overlap_fraction(w, iv[::-1]), [0.0, 0.5, 1.0, 0.0])  # any order
  np.testing.assert_allclose(overlap_fraction(w, iv[:0]), [0.0] * 4)


def test_trainer_contention_recovers_alone_and_extra_seconds():
  """Mini-batches that overlap rollout by a fraction x take alone + extra * x: the fit returns
  both; without spread in x, or when rollout does not slow the trainer, the mean and 0."""
  rng = np.random.default_rng(0)
  busy = np.array([[k * 0.1, k * 0.1 + 0.04] for k in range(200)])  # rollout 40% of the time
  start = np.sort(rng.uniform(0, 19.9, 300))
  x = overlap_fraction(np.stack([start, start + 0.01], 1), busy)  # 10 ms windows
  seconds = 0.008 + 0.005 * x
  ends = start + 0.01  # the windows the fit sees: (end time, seconds) with seconds = 10 ms
  alone, extra = trainer_contention(np.stack([ends, np.full(300, 0.01)], 1), busy)
  assert extra == pytest.approx(0.0, abs=1e-9)  # no dependence on overlap
  assert alone == pytest.approx(0.01)
  alone, extra = trainer_contention(np.stack([start + seconds, seconds], 1), busy)
  assert alone == pytest.approx(0.008, rel=0.05) and extra == pytest.approx(0.005, rel=0.1)
  mean, zero = trainer_contention(np.stack([start + 0.01, np.full(300, 0.01)], 1), busy[:0])
  assert (mean, zero) == (pytest.approx(0.01), 0.0)


def test_rollout_busy_spans_are_the_calls_that_held_or_started_groups():
  # launch, collect begin, collect end, running, iterations, decode passes, chunks, held, started
  rows = np.array(
    [
      [0.0, 0.1, 0.2, 1, 3, 3, 1, 0, 2],
      [0.3, 0.4, 0.5, 1, 3, 3, 0, 16, 0],
      [2.0, 2.1, 2.2, 0, 0, 0, 0, 0, 0],  # nothing held or started: idle
    ]
  )
  np.testing.assert_allclose(rollout_busy_intervals(rows), [[0.0, 0.2], [0.3, 0.5]])


def test_a_timeline_with_a_tenth_column_is_refused_in_one_sentence():
  rows = np.zeros((4, 10))
  with pytest.raises(ValueError, match="has 9 columns, not 10"):
    engine_timeline_fit(rows, groups_started=4)


def test_a_call_launched_behind_the_running_one_starts_when_it_ends():
  """A call launched while the one ahead still runs (the timeline allows it): the device goes from
  one to the next without a gap, and each call's device time runs from the end of the one ahead
  (its collect end) to its own collect end."""
  rng = np.random.default_rng(1)
  rows, device_free, t = [], 0.0, 0.0
  for _ in range(40):
    decode = int(rng.integers(1, 9))
    launch = t
    start = max(launch, device_free)
    device_free = start + A + B * decode
    rows.append((launch, device_free, device_free, 1.0, decode, decode, 0, 8, 1))
    t = start + 0.0005  # the next call is launched soon after this one starts running
  rows = np.asarray(rows)
  assert np.all(rows[1:, 0] < rows[:-1, 2])  # overlapping launches
  fit = engine_timeline_fit(rows, groups_started=40)
  assert fit["decode_s_per_iteration"] == pytest.approx(B, rel=1e-6)
  assert fit["host_gap_s"] == pytest.approx(0.0, abs=1e-9)
  assert fit["device_s"] == pytest.approx(A * 40 + B * rows[:, 5].sum(), rel=1e-6)
  assert fit["group_start_stall_fraction"] == pytest.approx(A * 40 / fit["device_s"], rel=1e-6)
