"""`python -m lab.bench.same_run`: the first step two runs' learning metrics part, clocks and
layout bookkeeping left out."""

import json

from lab.bench import same_run


def _write(path, rows):
  path.mkdir()
  (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_first_step_apart_ignores_clocks_and_layout_metrics(tmp_path, capsys):
  base = [{"step": s, "loss": 0.5 / s, "reward_mean": 0.1 * s, "step_s": s} for s in (1, 2, 3, 4)]
  other = [dict(r, step_s=9.0, share_tokens=7.0) for r in base]
  other[0]["loss"] *= 1 + 1e-7  # float summation order: equal within rtol
  other[2]["loss"] += 0.1  # apart from step 3 on
  _write(tmp_path / "a", base)
  _write(tmp_path / "b", other)
  out = tmp_path / "same.json"
  result = same_run.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)])
  assert result["steps_compared"] == 4
  assert result["first_step_apart"] == 3 and result["metrics_apart"] == ["loss"]
  assert 0 < result["max_rel_diff_before"] < 1e-6
  assert json.loads(out.read_text())["first_step_apart"] == 3
  assert "first apart at step 3 (loss)" in capsys.readouterr().out
