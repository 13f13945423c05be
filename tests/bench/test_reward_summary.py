"""First-vs-last reward of a run's metrics rows."""

import pytest

from knitjax.bench.reward_summary import summarize


def test_first_and_last_means():
  rows = [{"step": i + 1, "reward_mean": float(i), "wall_s": 2.0 * (i + 1)} for i in range(20)]
  s = summarize(rows, first=5, last=10, reach=6.0)
  # Trailing 10-step means: step 11 averages rewards 1..10 = 5.5, step 12 averages 2..11 = 6.5.
  assert s == {
    "steps": 20, "first5_reward": 2.0, "last10_reward": 14.5, "reach_step": 12, "wall_s": 40.0
  }  # fmt: skip
  assert summarize(rows, reach=100.0)["reach_step"] is None


def test_too_short_a_run_is_named():
  with pytest.raises(ValueError, match="has 3 steps"):
    summarize([{"reward_mean": 0.0}] * 3, first=5, last=10)
