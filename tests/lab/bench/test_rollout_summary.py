"""rollout_summary: one line per run; a run without the engine's call timeline is one sentence."""

import json

import pytest

from lab.bench import rollout_summary


def test_a_run_without_an_engine_timeline_is_refused_with_one_sentence(tmp_path):
  rows = [{"step": s, "step_s": 1.0, "reward_mean": 0.0} for s in (1, 2, 3)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (tmp_path / "timings.json").write_text(json.dumps({"calls": [], "engine_calls": []}))
  with pytest.raises(ValueError, match="no engine call timeline"):
    rollout_summary.summarize(str(tmp_path), warmup_steps=1)


def test_the_table_has_a_column_per_figure_and_a_line_per_run():
  row = {key: 1.0 for key, _, _ in rollout_summary.COLUMNS}
  lines = rollout_summary.table({"/runs/a": row, "/runs/b": row}).splitlines()
  assert len(lines) == 3 and lines[1].startswith("/runs/a") and "stall" in lines[0]
  assert lines[1].split()[1:] == lines[2].split()[1:]
