"""Tests for staleness accounting (hand-computed values)."""

import gc
import json
import math
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.staleness import StalenessTracker, staleness, summarize

_ids = iter(range(10**6))


def _group(gen, g, newest=None):
  return GroupMeta(
    group_id=next(_ids),
    cls="math",
    gen_version=gen,
    num_samples=g,
    prompt_tokens=(4,) * g,
    response_tokens=(8,) * g,
    gen_version_newest=newest,
  )


def _step_m4(newest_of_old=None):
  """M=4, v0=10: mini-batch j consumed at version 10 + j; (gen version, G) per group."""
  groups = [
    [(10, 2), (9, 1)],  # j=0 @10: s = 0 0 1, arch = 0 0 1
    [(10, 2), (8, 1)],  # j=1 @11: s = 1 1 3, arch = 0 0 2
    [(10, 1), (11, 1)],  # j=2 @12: s = 2 1,  arch = 0 0
    [(7, 2)],  # j=3 @13: s = 6 6,  arch = 3 3
  ]
  out = []
  for j, gs in enumerate(groups):
    metas = [_group(v, g, newest_of_old if v == 7 else None) for v, g in gs]
    out.append((MiniBatch(step=0, index=j, groups=tuple(metas)), 10 + j))
  return out


def test_staleness_function_hand_values():
  s, arch = staleness([10, 9, 5, 12], [12, 12, 12, 12], [2, 2, 2, 2])
  np.testing.assert_array_equal(s, [2, 3, 7, 0])
  np.testing.assert_array_equal(arch, [0, 1, 5, 0])
  assert s.dtype == np.int64 and arch.dtype == np.int64


def test_staleness_broadcasts_scalars():
  s, arch = staleness(np.array([[3], [5]]), 6, np.array([0, 1, 2]))
  np.testing.assert_array_equal(s, [[3, 3, 3], [1, 1, 1]])
  np.testing.assert_array_equal(arch, [[3, 2, 1], [1, 0, 0]])


@pytest.mark.parametrize(
  "args, match",
  [
    (([5], [4], [0]), "consume_version 4 is older than gen_version 5"),
    (([5], [6], [-1]), "minibatch_index"),
    (([5.0], [6], [0]), "gen_version has dtype float64"),
  ],
)
def test_staleness_rejects_impossible_input(args, match):
  with pytest.raises(ValueError, match=match):
    staleness(*args)


@settings(max_examples=50, deadline=None)
@given(
  st.lists(
    st.tuples(st.integers(0, 50), st.integers(0, 20), st.integers(0, 7)), min_size=0, max_size=30
  )
)
def test_staleness_matches_scalar_definition(rows):
  gen = np.array([r[0] for r in rows], np.int64)
  cons = np.array([r[0] + r[1] for r in rows], np.int64)
  j = np.array([r[2] for r in rows], np.int64)
  s, arch = staleness(gen, cons, j)
  assert s.tolist() == [r[1] for r in rows]
  assert arch.tolist() == [max(0, r[1] - r[2]) for r in rows]


def test_summarize_hand_values():
  out = summarize([1, 2, 3, 4], "x")
  assert out == pytest.approx(
    {"x_mean": 2.5, "x_p50": 2.5, "x_p99": 3.97, "x_max": 4.0, "x_count": 4.0}
  )


def test_summarize_empty_is_nan_with_zero_count():
  out = summarize([], "x")
  assert out["x_count"] == 0
  assert all(math.isnan(out[f"x_{k}"]) for k in ("mean", "p50", "p99", "max"))


def test_tracker_m4_hand_computed():
  tracker = StalenessTracker()
  for mb, version in _step_m4():
    tracker.record(mb, version)
  m = tracker.step_metrics(0)
  # staleness 0 0 1 | 1 1 3 | 2 1 | 6 6 -> sorted 0 0 1 1 1 1 2 3 6 6
  assert m["staleness_mean"] == pytest.approx(2.1)
  assert m["staleness_p50"] == 1.0
  assert m["staleness_p99"] == 6.0
  assert m["staleness_max"] == 6.0
  assert m["staleness_count"] == 10
  # arch 0 0 1 | 0 0 2 | 0 0 | 3 3 -> sorted 0 0 0 0 0 0 1 2 3 3
  assert m["arch_staleness_mean"] == pytest.approx(0.9)
  assert m["arch_staleness_p50"] == 0.0
  assert m["arch_staleness_p99"] == pytest.approx(3.0)
  assert m["arch_staleness_max"] == 3.0
  # unclamped s - j: 0 0 1 | 0 0 2 | 0 -1 | 3 3 -> 8 / 10 (the -1 is fresher than colocated)
  assert m["arch_staleness_unclamped_mean"] == pytest.approx(0.8)
  assert m["minibatches"] == 4
  assert not any("newest" in k for k in m)


def test_tracker_newest_convention():
  tracker = StalenessTracker()
  for mb, version in _step_m4(newest_of_old=12):  # the gen-7 group finished on version 12
    tracker.record(mb, version)
  m = tracker.step_metrics(0)
  assert m["staleness_mean"] == pytest.approx(2.1)  # oldest-version convention unchanged
  # newest: 0 0 1 | 1 1 3 | 2 1 | 1 1 ; arch newest: 0 0 1 | 0 0 2 | 0 0 | 0 0
  assert m["staleness_newest_mean"] == pytest.approx(1.1)
  assert m["staleness_newest_max"] == 3.0
  assert m["arch_staleness_newest_mean"] == pytest.approx(0.3)
  assert m["arch_staleness_newest_max"] == 2.0


def test_tracker_report_newest_always():
  tracker = StalenessTracker(report_newest=True)
  for mb, version in _step_m4():
    tracker.record(mb, version)
  m = tracker.step_metrics(0)
  assert m["arch_staleness_newest_mean"] == pytest.approx(m["arch_staleness_mean"])


def test_tracker_separates_steps_and_forgets_them():
  tracker = StalenessTracker()
  tracker.record(MiniBatch(step=0, index=0, groups=(_group(3, 2),)), 4)
  tracker.record(MiniBatch(step=1, index=0, groups=(_group(3, 1),)), 6)
  assert tracker.steps() == [0, 1]
  assert tracker.step_metrics(1)["staleness_mean"] == 3.0
  assert tracker.steps() == [0]
  assert tracker.step_metrics(0)["staleness_mean"] == 1.0
  empty = tracker.step_metrics(0)
  assert empty["staleness_count"] == 0 and math.isnan(empty["staleness_mean"])


def test_tracker_rejects_duplicate_and_impossible_records():
  tracker = StalenessTracker()
  mb = MiniBatch(step=2, index=1, groups=(_group(5, 1),))
  tracker.record(mb, 6)
  with pytest.raises(ValueError, match="mini-batch 1 of step 2 was recorded already"):
    tracker.record(mb, 7)
  with pytest.raises(ValueError, match="older than gen_version"):
    tracker.record(MiniBatch(step=2, index=2, groups=(_group(9, 1),)), 6)
  assert tracker.step_metrics(2)["staleness_count"] == 1  # the bad record left no trace


def test_tracker_state_dict_round_trip():
  tracker = StalenessTracker()
  for mb, version in _step_m4(newest_of_old=12)[:3]:
    tracker.record(mb, version)
  state = json.loads(json.dumps(tracker.state_dict()))  # plain Python, checkpointable
  restored = StalenessTracker()
  restored.load_state_dict(state)
  last_mb, last_version = _step_m4(newest_of_old=12)[3]
  tracker.record(last_mb, last_version)
  restored.record(last_mb, last_version)
  assert restored.step_metrics(0) == tracker.step_metrics(0)


def _python_lines(fn, *args):
  """Python source lines executed by ``fn(*args)``: the interpreter's share of the work.

  Garbage collection is held off while tracing (a finalizer of an unrelated object, e.g. an
  event loop another test left behind, would add its lines), and only lines of knitjax and
  NumPy count."""
  lines = 0

  def tracer(frame, event, arg):
    nonlocal lines
    path = frame.f_code.co_filename
    lines += event == "line" and ("knitjax" in path or "numpy" in path)
    return tracer

  gc.collect()
  was_enabled = gc.isenabled()
  gc.disable()
  before = sys.gettrace()
  sys.settrace(tracer)
  try:
    fn(*args)
  finally:
    sys.settrace(before)
    if was_enabled:
      gc.enable()
  return lines


def test_python_work_does_not_grow_with_the_number_of_trajectories():
  """Vectorised means the per-trajectory work is NumPy's: a million trajectories run the same
  Python lines as ten (a Python loop over trajectories would run at least one more per item).
  Wall-clock speed is benchmarked, never timed here."""
  rng = np.random.default_rng(0)

  def arrays(n):
    gen = rng.integers(0, 1000, n)
    return gen, gen + rng.integers(0, 8, n), rng.integers(0, 4, n)

  small, big = arrays(10), arrays(1_000_000)
  summarize(small[1] - small[0], "x")  # NumPy imports some percentile code on first use
  assert _python_lines(staleness, *big) == _python_lines(staleness, *small)
  s, arch = staleness(*big)
  assert _python_lines(summarize, s, "x") == _python_lines(summarize, small[1] - small[0], "x")
  out = {**summarize(s, "staleness"), **summarize(arch, "arch_staleness")}
  assert out["staleness_count"] == out["arch_staleness_count"] == 1_000_000
  # Gaps are drawn from 0..7; among a million rows some gap is 7 with j = 0.
  assert out["staleness_max"] == out["arch_staleness_max"] == 7
