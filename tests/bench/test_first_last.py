"""knitjax.bench.first_last: first and last steps' means of a run's metrics."""

import json

import pytest

from knitjax.bench.first_last import first_last, main


def test_first_last_means_and_missing_values():
  rows = [{"step": s, "reward_mean": float(s), "x": None if s == 1 else 1.0} for s in range(1, 21)]
  assert first_last(rows, "reward_mean") == (3.0, 15.5)  # steps 1..5, steps 11..20
  assert first_last(rows, "x", first=2, last=3) == (1.0, 1.0)  # None is skipped
  with pytest.raises(ValueError, match="no metrics row holds 'nope'"):
    first_last(rows, "nope")


def test_main_prints_each_key(tmp_path, capsys):
  rows = [{"step": s, "reward_mean": s / 10, "wall_s": 2.0 * s} for s in range(1, 11)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  main([str(tmp_path), "--first", "2", "--last", "2"])
  out = capsys.readouterr().out
  assert "10 steps, wall 20.0 s" in out
  assert "reward_mean: first 2 steps 0.150, last 2 steps 0.950" in out
