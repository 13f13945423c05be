"""Frontier comparison: reduction at matched throughput, gain at equal depth, dominance."""

import pytest

from knitjax.sim.frontier import compare, depth_grid


def _f(points):
  return [{"max_lag_steps": d, "steps_per_hour": x, "arch_staleness_mean": a} for d, x, a in points]


def test_depth_grid():
  assert depth_grid(4) == [0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0]
  assert depth_grid(2, 1.0) == [0, 0.5, 1.0]


def test_reduction_and_gain():
  base = _f([(0, 5, 0.0), (0.5, 8, 2.0), (1.0, 10, 4.0)])
  cand = _f([(0, 6, 0.0), (0.5, 11, 1.0), (1.0, 14, 3.0)])
  c = compare(base, cand)
  assert c["matched_depth"] == 0.5
  assert c["reduction"] == pytest.approx(1 - 1.0 / 4.0)
  # Interpolated: 10 steps/hour lies 4/5 of the way from 6 to 11 -> staleness 0.8.
  assert c["reduction_interpolated"] == pytest.approx(1 - 0.8 / 4.0)
  assert c["throughput_gain"] == pytest.approx(1.4)
  assert c["dominates"]


def test_no_match_and_not_dominating():
  base = _f([(0, 5, 0.0), (1.0, 10, 4.0)])
  cand = _f([(0, 4, 0.0), (1.0, 9, 1.0)])
  c = compare(base, cand)
  assert c["reduction"] is None and c["matched_depth"] is None
  assert not c["dominates"]
  staler = _f([(0, 6, 1.0), (1.0, 10, 5.0)])
  c = compare(base, staler)
  assert c["staler_at_matched_throughput"] == [0, 1.0] and not c["dominates"]
