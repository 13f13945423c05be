"""MetricsWriter: one row per step across resumes; only the primary process writes."""

import json
import logging
import os
import types

import pytest

from knitjax.runtime import metrics
from knitjax.runtime.metrics import MetricsWriter, plot_reward, read_metrics


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


def _progress_lines(caplog):
  return [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]


def _fake_clock(monkeypatch):
  """A clock the test moves by hand (``clock.now``), in place of the metrics module's."""
  clock = types.SimpleNamespace(now=0.0)
  fake = types.SimpleNamespace(time=lambda: clock.now, monotonic=lambda: clock.now)
  monkeypatch.setattr(metrics, "time", fake)
  return clock


def test_eta_is_timed_from_the_steps_after_the_first(tmp_path, caplog, monkeypatch):
  # Step 1 (XLA compile) takes 600 s, every later step 2 s: extrapolating from step 1 would
  # say 600 * 19 s; the ETA skips it and is known from step 2 on.
  clock = _fake_clock(monkeypatch)
  w = MetricsWriter(str(tmp_path), total_steps=20, log_every=10, primary=True)
  with caplog.at_level(logging.INFO, logger="absl"):  # whatever verbosity runs before
    for step in range(1, 21):
      clock.now += 600.0 if step == 1 else 2.0
      w.write(step, {"reward_mean": 0.5, "loss": 0.1})
  w.close()
  lines = _progress_lines(caplog)
  assert [line.split("  ")[0] for line in lines] == ["step 1/20", "step 10/20", "step 20/20"]
  assert lines[0].endswith("  ETA after step 2")
  assert lines[1].endswith("  ETA 20s")  # 10 steps left at 2 s each
  assert lines[2].endswith("  ETA 0s")


def test_eta_after_a_resume_skips_the_first_step_of_this_process(tmp_path, caplog, monkeypatch):
  clock = _fake_clock(monkeypatch)
  w = MetricsWriter(str(tmp_path), total_steps=12, start_step=5, log_every=4, primary=True)
  with caplog.at_level(logging.INFO, logger="absl"):  # whatever verbosity runs before
    for step in range(6, 9):
      clock.now += 300.0 if step == 6 else 3.0
      w.write(step, {"reward_mean": 0.5, "loss": 0.1})
  w.close()
  lines = _progress_lines(caplog)
  assert lines[0].startswith("step 6/12") and lines[0].endswith("ETA after step 7")
  assert lines[1].startswith("step 8/12") and lines[1].endswith("ETA 12s")  # 4 left at 3 s


def test_reward_plot_is_titled_with_the_config_and_workdir(tmp_path, monkeypatch):
  from matplotlib.figure import Figure

  titles = []
  save = Figure.savefig

  def savefig(fig, *args, **kwargs):
    titles.append(fig.axes[0].get_title())
    return save(fig, *args, **kwargs)

  monkeypatch.setattr(Figure, "savefig", savefig)
  _write_rows(tmp_path / "metrics.jsonl", [{"step": 1, "reward_mean": 0.25}])
  path = plot_reward(str(tmp_path), config_name="configs/arith_tiny.py:quick")
  assert path == str(tmp_path / "reward.png") and os.path.getsize(path) > 0
  plot_reward(str(tmp_path))  # a notebook's run: no config name
  assert titles == [
    f"reward: configs/arith_tiny.py:quick\nworkdir {tmp_path}",
    f"reward\nworkdir {tmp_path}",
  ]


def _write_rows(path, rows, tail=""):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
    f.write(tail)


def _warnings(caplog):
  return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_resume_drops_a_torn_last_line_with_a_warning(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  _write_rows(path, [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}], tail='{"step": 3, "lo')
  with caplog.at_level(logging.WARNING):
    w = MetricsWriter(str(tmp_path), total_steps=4, start_step=2, primary=True)
  w.write(3, {"loss": 0.125})
  w.close()
  assert read_metrics(str(tmp_path)) == [
    {"step": 1, "loss": 0.5},
    {"step": 2, "loss": 0.25},
    {"step": 3, "loss": 0.125},
  ]
  assert any(f"dropping the torn last line 3 of {path}" in m for m in _warnings(caplog))


def test_resume_keeps_a_complete_last_row_that_lost_its_newline(tmp_path):
  _write_rows(tmp_path / "metrics.jsonl", [{"step": 1}], tail='{"step": 2}')
  w = MetricsWriter(str(tmp_path), total_steps=3, start_step=2, primary=True)
  w.write(3, {"loss": 1.0})
  w.close()
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]


def test_read_metrics_drops_a_torn_last_line(tmp_path, caplog):
  _write_rows(tmp_path / "metrics.jsonl", [{"step": 1}, {"step": 2}], tail='{"step": 3, "re')
  with caplog.at_level(logging.WARNING):
    assert read_metrics(str(tmp_path)) == [{"step": 1}, {"step": 2}]
  assert any("torn last line 3" in m for m in _warnings(caplog))


def test_a_torn_line_before_the_last_is_one_sentence(tmp_path):
  path = tmp_path / "metrics.jsonl"
  with open(path, "w") as f:
    f.write('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
  message = (
    f"{path} line 2 is not a JSON object (Unterminated string starting at); only a torn last "
    "line (a crash mid-write) is dropped, so repair or delete that line."
  )
  with pytest.raises(ValueError) as e:
    read_metrics(str(tmp_path))
  assert str(e.value) == message
  with pytest.raises(ValueError) as e:
    MetricsWriter(str(tmp_path), total_steps=4, start_step=3, primary=True)
  assert str(e.value) == message
