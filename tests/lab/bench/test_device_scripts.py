"""lab/scripts/device/smollm2_learn.sh on the CPU: the tiny recipe and benchmark, and its refusals.

The full run uses the real SmolLM2-135M-Instruct from the knitjax cache (skipped when it cannot
be had) with configs/smollm2_learn.py:tiny (two steps of the learning recipe) and
configs/bench/real_model.py:quick, ALLOW_CPU=1.
"""

import hashlib
import itertools
import json
import os
import subprocess
import sys

import numpy as np

from lab import without_device_count
from tests.lab.bench.test_real_model_bench import check_quick_result

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(REPO, "lab", "scripts", "device", "smollm2_learn.sh")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _run(tmp_path, cache, timeout=60, **env):
  env = {
    **without_device_count(os.environ),  # one CPU device, as users run
    "ALLOW_CPU": "1",
    "PYTHON": sys.executable,
    "KNITJAX_CACHE": str(cache),
    "RUN_DIR": str(tmp_path / "run"),
    "WHEELS": str(
      tmp_path / "no-wheels"
    ),  # this venv has the packages; a checkout's .whl/ is for the GPU
    **env,
  }
  out = tmp_path / "out"
  done = subprocess.run(
    ["bash", SCRIPT, str(out)], env=env, capture_output=True, text=True, timeout=timeout
  )
  return done, out


def test_a_missing_model_is_one_line(tmp_path):
  done, _ = _run(tmp_path, tmp_path / "empty")
  assert done.returncode == 2
  assert done.stderr.strip().splitlines() == [
    f"error: SmolLM2-135M-Instruct is not in {tmp_path / 'empty'}: put gguf/{GGUF} (or its .part0 "
    "and .part1, lab/scripts/device/prepare_carry.sh) there."
  ]


def test_wheels_for_another_python_are_refused_in_one_line(tmp_path):
  wheels = tmp_path / "wheels"
  wheels.mkdir()
  (wheels / "grain-0.2.18-cp27-cp27m-manylinux1_x86_64.whl").write_bytes(b"")
  done, _ = _run(tmp_path, tmp_path / "empty", WHEELS=str(wheels))
  assert done.returncode == 2
  (line,) = done.stderr.strip().splitlines()
  assert line.startswith("error: the wheels folder holds wheels for another python than this ")
  assert "grain-0.2.18-cp27-cp27m-manylinux1_x86_64.whl" in line


def test_parts_are_joined_only_when_complete_and_matching(tmp_path):
  gguf = tmp_path / "cache" / "gguf"
  gguf.mkdir(parents=True)
  (gguf / f"{GGUF}.part0").write_bytes(b"abc")
  done, _ = _run(tmp_path, tmp_path / "cache")
  assert done.returncode == 2 and f"{GGUF}.part1 is missing" in done.stderr
  (gguf / f"{GGUF}.part1").write_bytes(b"def")
  wrong = hashlib.sha256(b"abcxyz").hexdigest()
  (gguf / f"{GGUF}.sha256").write_text(f"{wrong}  {GGUF}\n")
  done, _ = _run(tmp_path, tmp_path / "cache")
  assert done.returncode == 2 and "does not match" in done.stderr.splitlines()[-1]
  assert not (gguf / GGUF).exists()  # a bad join is not left for the converter


def test_the_tiny_recipe_and_benchmark_on_the_cpu(tmp_path, smollm2_folder):
  # Without the tests' `--xla_cpu_use_fusion_emitters=false` (tests/conftest.py): at SmolLM2's
  # size the unfused code costs more run time than the faster compiles save (162 CPU-s with it,
  # 117 without, measured in the whole suite on 2 cores).
  flags = without_device_count(os.environ).get("XLA_FLAGS", "").split()
  done, out = _run(
    tmp_path,
    os.environ.get("KNITJAX_CACHE") or os.path.expanduser("~/.cache/knitjax"),
    timeout=900,
    XLA_FLAGS=" ".join(f for f in flags if not f.startswith("--xla_cpu_use_fusion_emitters")),
    CONFIG="configs/smollm2_learn.py:tiny",
    BENCH_CONFIG="configs/bench/real_model.py:quick",
  )
  assert done.returncode == 0, done.stderr[-2000:]
  names = {p.name for p in out.iterdir()}
  assert names == {
    "env.txt",
    "run.log",
    "bench.log",
    "eval.jsonl",
    "eval.png",
    "metrics.jsonl",
    "real_model.json",
    "real_model.png",
  }  # at most 8: what a device call brings back
  assert "exit codes: run 0, bench 0" in (out / "env.txt").read_text()
  # Two steps of the learning recipe's tiny variant, as the test of the recipe: the per-step
  # figures the recipe reports, and held-out accuracy with its interval before and after.
  rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert np.isfinite(r["loss"]) and 0.0 <= r["reward_mean"] <= 1.0
    assert 0.0 <= r["signal_groups"] <= 1.0 and 1 <= r["response_len_mean"] <= 8
  evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
  assert [r["step"] for r in evals] == [0, 2]
  for r, prefix in itertools.product(evals, ("eval_", "eval_heldout_phrasings_")):
    # Held-out numbers and held-out phrasings, each with its interval.
    assert r[f"{prefix}prompts"] == 4
    assert r[f"{prefix}greedy_accuracy_low"] <= r[f"{prefix}greedy_accuracy"]
    assert r[f"{prefix}greedy_accuracy"] <= r[f"{prefix}greedy_accuracy_high"]
  result = json.loads((out / "real_model.json").read_text())
  assert (out / "real_model.png").stat().st_size > 0
  check_quick_result(result)  # the real-model bench's quick run, checked in full
