"""``python -m lab.bench``: a bad config file, bench name or workdir is one sentence, not a
traceback, and nothing is made before it."""

import os
import pathlib
import subprocess
import sys

import pytest

from configs.bench import admission as admission_config
from configs.bench import dedup as dedup_config
from lab.bench import __main__ as bench_main

_ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_every_bench_has_a_config_and_a_module():
  names = bench_main.benches()
  assert {"admission", "dedup", "cluster"} <= set(names) and "report" not in names
  for name in names:
    assert (_ROOT / "lab" / "bench" / f"{name}.py").is_file(), name


@pytest.mark.parametrize("name", ["report", "__main__", "nope"])
def test_a_name_that_is_no_benchmark_is_refused(name):
  config = admission_config.get_config("quick")
  config.bench = name
  problem = bench_main.bench_problem(config)
  assert problem.startswith(f"config.bench={name!r} is not a benchmark; choose one of: admission, ")


def test_another_benchs_config_is_refused_naming_its_fields():
  config = admission_config.get_config("quick")
  config.bench = "dedup"
  assert bench_main.bench_problem(config) == (
    "config.bench='dedup' does not fit this config, which lacks dedup's fields (cpu_devices, "
    "devices, mesh_shape, model, vision); run --config configs/bench/dedup.py for dedup."
  )
  assert bench_main.bench_problem(admission_config.get_config("quick")) is None
  assert bench_main.bench_problem(dedup_config.get_config()) is None


def _bench(*args):
  cmd = [sys.executable, "-m", "lab.bench", *args]
  env = dict(os.environ, PYTHONPATH=str(_ROOT))
  return subprocess.run(cmd, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_a_missing_config_file_is_one_sentence(tmp_path):
  proc = _bench("--config=configs/bench/nope.py", f"--workdir={tmp_path / 'w'}")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().startswith(
    "error: --config configs/bench/nope.py is not a file; give a benchmark config, "
    "configs/bench/<name>.py (one of: admission, "
  )
  assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("where", ["file", "proc"])
def test_a_workdir_that_cannot_hold_results_is_one_sentence(tmp_path, where):
  from lab.bench import admission

  workdir = tmp_path / "file" if where == "file" else pathlib.Path("/proc/knitjax-bench-test")
  if where == "file":
    workdir.write_text("")
  expected = "is a file, not a folder." if where == "file" else "is not writable ("
  with pytest.raises(ValueError, match=f"^--workdir {workdir} {expected}".replace("(", r"\(")):
    bench_main.check_run(admission, admission_config.get_config("quick"), str(workdir))


def test_the_benchs_fields_are_checked_before_the_workdir_is_made(tmp_path):
  from lab.bench import admission

  config = admission_config.get_config("quick")
  config.repeats = 0
  with pytest.raises(ValueError, match=r"config\.repeats=0 is not accepted"):
    bench_main.check_run(admission, config, str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()
