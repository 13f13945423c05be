"""The step-time benchmark: timed from the real loop, and side by side with a baseline script."""

import json
import sys

import pytest

from configs.bench import step_time as step_time_config
from knitjax.bench import step_time

# Stands in for knitjax/bench/external/tunix_step_time.py: same CLI (--out PATH), same JSON key.
_FAKE_BASELINE = """
import argparse, json
p = argparse.ArgumentParser()
p.add_argument("--out")
with open(p.parse_args().out, "w") as f:
  json.dump({"median_s": 0.5}, f)
"""


@pytest.mark.slow
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
    assert row["ratio"] == pytest.approx(0.5 / row["median_s"])
    assert row["timed_steps"] == config.run.runtime.steps - config.warmup_steps
  assert result["sequences_per_step"] == 16


def test_missing_baseline_python_is_one_clear_error(tmp_path):
  config = step_time_config.get_config("quick")
  config.baseline_python = str(tmp_path / "no-venv" / "bin" / "python")
  with pytest.raises(ValueError, match="baseline_python=.*is not a file"):
    step_time.run(config, str(tmp_path))
