"""reward_summary: first and last steps' mean reward of a run."""

import pytest

from knitjax.bench.reward_summary import summarize


def test_first_and_last_means_and_diagnostics():
  rows = [
    {"step": s, "reward_mean": s / 20, "wall_s": 2.0 * s, "kl": 0.1, "value_loss": s}
    for s in range(1, 21)
  ]
  got = summarize(rows, first=5, last=10)
  assert got["first_mean"] == pytest.approx(0.15)  # steps 1..5
  assert got["last_mean"] == pytest.approx(0.775)  # steps 11..20
  assert got["steps"] == 20 and got["wall_s"] == 40
  assert got["last_kl"] == pytest.approx(0.1) and got["last_value_loss"] == pytest.approx(15.5)
  assert "last_entropy" not in got
  with pytest.raises(ValueError, match="need at least first \\+ last = 15"):
    summarize(rows[:14])
