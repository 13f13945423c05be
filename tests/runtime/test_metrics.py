"""MetricsWriter: one row per step across resumes; only the primary process writes."""

import os

from knitjax.runtime.metrics import MetricsWriter, read_metrics


def test_resume_drops_rows_after_the_checkpoint(tmp_path):
  w = MetricsWriter(str(tmp_path), total_steps=4, primary=True)
  for step in (1, 2, 3):
    w.write(step, {"reward_mean": 0.1 * step, "loss": 0.0})
  w.close()
  w = MetricsWriter(str(tmp_path), total_steps=4, start_step=2, primary=True)  # resumed at 2
  w.write(3, {"reward_mean": 0.5, "loss": float("nan")})
  w.close()
  rows = read_metrics(str(tmp_path))
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert rows[-1]["reward_mean"] == 0.5 and rows[-1]["loss"] is None  # NaN -> null


def test_non_primary_process_writes_nothing(tmp_path):
  w = MetricsWriter(str(tmp_path / "run"), total_steps=2, primary=False)
  w.write(1, {"reward_mean": 1.0})
  w.close()
  assert not os.path.exists(tmp_path / "run")
