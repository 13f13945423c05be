"""reward_summary: a run's first-vs-last means, how fast it learned, its diagnostics."""

import json

import pytest

from lab.bench.reward_summary import _main, first_last, summarize


def test_first_and_last_means_reach_and_diagnostics():
  rows = [
    {"step": i + 1, "reward_mean": float(i), "wall_s": 2.0 * (i + 1), "kl": 0.1, "value_loss": i}
    for i in range(20)
  ]
  s = summarize(rows, first=5, last=10, reach=6.0)
  # Trailing 10-step means: step 11 averages rewards 1..10 = 5.5, step 12 averages 2..11 = 6.5.
  assert s == {
    "steps": 20, "first_reward": 2.0, "last_reward": 14.5, "reach_step": 12, "wall_s": 40.0,
    "first_kl": pytest.approx(0.1), "last_kl": pytest.approx(0.1),
    "first_value_loss": 2.0, "last_value_loss": 14.5,
  }  # fmt: skip
  assert summarize(rows, reach=100.0)["reach_step"] is None


def test_first_last_skips_missing_values_and_names_an_unknown_key():
  rows = [{"step": s, "reward_mean": float(s), "x": None if s == 1 else 1.0} for s in range(1, 21)]
  assert first_last(rows, "reward_mean") == (3.0, 15.5)  # steps 1..5, steps 11..20
  assert first_last(rows, "x", first=2, last=3) == (1.0, 1.0)  # None is skipped
  with pytest.raises(ValueError, match="no metrics row holds 'nope'"):
    first_last(rows, "nope")


def test_too_short_a_run_is_named():
  with pytest.raises(ValueError, match="has 3 steps"):
    summarize([{"reward_mean": 0.0}] * 3, first=5, last=10)


def test_main_prints_the_reward_and_each_logged_key(tmp_path, capsys):
  rows = [
    {"step": s, "reward_mean": s / 10, "wall_s": 2.0 * s, "solved_fraction": s / 20}
    for s in range(1, 11)
  ]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  _main([str(tmp_path), "--first", "2", "--last", "2", "--reach", "0.5"])
  out = capsys.readouterr().out
  assert "10 steps, reward first 2 0.150, last 2 0.950" in out
  assert "reaches 0.5 at step 6, wall 20.0 s" in out  # trailing 2: (0.5 + 0.6) / 2 at step 6
  assert "solved_fraction: first 0.075, last 0.475" in out
