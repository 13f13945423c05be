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


def test_a_tie_on_a_throughput_plateau_is_a_match():
  """Both saturate at the same throughput; float noise puts the candidate a hair below.

  The figures are the issue's: 6045.7104072475795 vs 6045.710407247576 steps/h (true reduction
  88.3% here by construction), and 5.0000 vs 4.9993. Exact comparisons gave None / False.
  """
  base = _f([(0, 3000.0, 0.0), (0.5, 5000.0, 1.0), (1.0, 6045.7104072475795, 3.0)])
  cand = _f([(0, 3500.0, 0.0), (0.5, 6045.710407247576, 0.35), (1.0, 6045.710407247576, 0.35)])
  c = compare(base, cand)
  assert c["matched_depth"] == 0.5
  assert c["reduction"] == pytest.approx(1 - 0.35 / 3.0)  # 88.3%
  assert c["reduction_interpolated"] == pytest.approx(1 - 0.35 / 3.0)
  assert c["reduction_equal_config"] == pytest.approx(1 - 0.35 / 3.0)
  assert c["dominates"]
  plateau_base = _f([(0, 2.0, 0.0), (1.0, 5.0, 2.0)])
  plateau_cand = _f([(0, 2.5, 0.0), (1.0, 4.9993, 1.0)])
  c = compare(plateau_base, plateau_cand)
  assert c["matched_depth"] == 1.0 and c["reduction"] == pytest.approx(0.5)
  assert c["dominates"]  # -0.014% is within the tolerance
  # Without a tolerance the old, exact behaviour: no match, not dominating.
  c = compare(plateau_base, plateau_cand, rtol=0.0)
  assert c["reduction"] is None and not c["dominates"]
  # A real gap is not a tie.
  c = compare(plateau_base, _f([(0, 2.5, 0.0), (1.0, 4.9, 1.0)]))
  assert c["reduction"] is None and not c["dominates"]
  with pytest.raises(ValueError, match="rtol"):
    compare(plateau_base, plateau_cand, rtol=1.0)


def test_equal_configuration_reduction_is_at_the_same_depth():
  base = _f([(0, 5, 0.0), (1.0, 10, 4.0)])
  cand = _f([(0, 6, 0.0), (1.0, 14, 3.0)])
  assert compare(base, cand)["reduction_equal_config"] == pytest.approx(0.25)
