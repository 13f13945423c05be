"""The step-time benchmark: timed from the real loop, and side by side with a baseline script."""

import json
import sys

import pytest

from configs.bench import step_time as step_time_config
from lab.bench import step_time

# Stands in for lab/bench/external/tunix_step_time.py: same CLI (--out PATH), same JSON key.
_FAKE_BASELINE = """
import argparse, json
p = argparse.ArgumentParser()
p.add_argument("--out")
with open(p.parse_args().out, "w") as f:
  json.dump({"median_s": 0.5}, f)
"""


def test_quick_side_by_side_rounds_report_ratios(tmp_path):
  script = tmp_path / "fake_baseline.py"
  script.write_text(_FAKE_BASELINE)
  config = step_time_config.get_config("quick")
  config.rounds = 2
  config.baseline_python = sys.executable
  config.baseline_script = str(script)
  result = step_time.run(config, str(tmp_path / "out"))
  with open(tmp_path / "out" / "step_time.json") as f:
    assert json.load(f) == json.loads(json.dumps(result))
  assert [r["round"] for r in result["rounds"]] == [0, 1]
  for row in result["rounds"]:
    assert row["baseline_median_s"] == 0.5
    # The headline ratio is end to end (as the baseline script times), the body ratio beside it.
    assert row["ratio"] == pytest.approx(0.5 / row["wall_median_s"])
    assert row["ratio_step_s"] == pytest.approx(0.5 / row["median_s"])
    assert row["wall_median_s"] >= row["median_s"]
    assert row["timed_steps"] == config.run.loop.steps - config.warmup_steps
  assert result["sequences_per_step"] == 16


def test_missing_baseline_python_is_one_clear_error(tmp_path):
  config = step_time_config.get_config("quick")
  config.baseline_python = str(tmp_path / "no-venv" / "bin" / "python")
  with pytest.raises(ValueError, match="baseline_python=.*is not a file"):
    step_time.run(config, str(tmp_path))


def test_end_to_end_time_counts_host_work_between_steps():
  # Three steps whose bodies take 1 s but which end 1.5 s apart: 0.5 s of host work per step
  # outside step_s (metrics row, checkpoint decision, set-up). Made-up rows, figures by hand.
  rows = [{"step_s": 1.0, "wall_s": w, "rollout_s": 0.4, "train_s": 0.6} for w in (9.0, 10.5, 12.0)]
  got = step_time.step_times(rows, warmup_steps=1, steps=3)
  assert got["wall_median_s"] == pytest.approx(1.5)  # 10.5 - 9.0 and 12.0 - 10.5
  assert got["median_s"] == pytest.approx(1.0)
  assert got["timed_steps"] == 2
  with pytest.raises(ValueError, match="leaves no step after warmup_steps=3"):
    step_time.step_times(rows, warmup_steps=3, steps=3)
