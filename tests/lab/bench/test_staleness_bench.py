"""The staleness benchmark's quick variant writes the JSON shape the issue asks for."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from lab.bench import staleness

_ROOT = pathlib.Path(__file__).parents[3]
_CONFIG = _ROOT / "configs" / "bench" / "staleness.py"
_spec = importlib.util.spec_from_file_location("staleness_config", _CONFIG)
staleness_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(staleness_config)


def test_quick_variant_writes_required_fields(tmp_path):
  config = staleness_config.get_config("quick")
  out = staleness.run(config, str(tmp_path))
  with open(tmp_path / "staleness.json") as f:
    saved = json.load(f)
  assert os.path.getsize(tmp_path / "staleness.png") > 10_000
  assert set(saved["policies"]) == {"train_batch", "minibatch", "greedy", "colocated"}
  for name, entry in saved["policies"].items():
    assert entry["max_lag_steps"] == (0.0 if name == "colocated" else 1.0)
    assert entry["arch_staleness_mean"] >= 0 and entry["quota_violations"] >= 0
  assert saved["policies"]["colocated"]["arch_staleness_max"] == 0
  depths = [0.0, 0.25, 0.5, 0.75, 1.0]
  for policy in ("train_batch", "minibatch", "greedy"):
    pts = saved["frontier"][policy]
    assert [p["max_lag_steps"] for p in pts] == depths
    assert all(p["steps_per_hour"] > 0 and "arch_staleness_mean" in p for p in pts)
  assert len(saved["frontier"]["colocated"]) == 1
  # reduction and throughput_gain follow their definitions on the saved frontier.
  base = saved["frontier"]["train_batch"][4]
  mb = saved["frontier"]["minibatch"]
  rtol = saved["comparison"]["rtol"]
  matched = next(p for p in mb if p["steps_per_hour"] >= base["steps_per_hour"] * (1 - rtol))
  assert saved["reduction"] == pytest.approx(
    1 - matched["arch_staleness_mean"] / base["arch_staleness_mean"]
  )
  assert saved["throughput_gain"] == pytest.approx(mb[4]["steps_per_hour"] / base["steps_per_hour"])
  assert saved["throughput_gain"] > 1
  # The reference mix under minibatch admission: no violations, no stalls, at every depth.
  assert saved["checks"]["minibatch_quota_violations_all_depths"] == 0
  assert saved["checks"]["minibatch_stalls_all_depths"] == 0
  assert saved["checks"]["greedy_quota_violations_all_depths"] > 0
  assert {"mid_generation"} == set(saved["adoption"])
  assert set(saved["weight_sync"]) == {"step"}
  assert set(saved["scheduling"]["dynamic_sampling"]) == {"plain", "admission_aware"}
  assert [s["name"] for s in saved["sweep"]] == ["math_cv_0.5"]
  assert saved["speed"]["trajectories"] >= 20_000
  assert out["reduction"] == saved["reduction"]
  # The generation bound per mini-batch position: mean over j of max(0, generating - j), never
  # looser than the floor of the mean gap (the clamp is convex).
  g = saved["generation_bound"]
  m = config.minibatches
  by_j = [max(0.0, g["generating_versions"] - j) for j in range(m)]
  assert g["arch_staleness_floor_by_position"] == pytest.approx(by_j)
  assert g["arch_staleness_floor_per_position"] == pytest.approx(sum(by_j) / m)
  assert g["arch_staleness_floor_per_position"] >= g["arch_staleness_floor"] - 1e-12
  eq = 1 - mb[4]["arch_staleness_mean"] / base["arch_staleness_mean"]
  assert saved["comparison"]["reduction_equal_config"] == pytest.approx(eq)
  assert all("arch_staleness_unclamped_mean" in p for p in mb)


def test_cli_overrides_workload_fields(tmp_path):
  cmd = [
    sys.executable,
    "-m",
    "lab.bench",
    f"--config={_CONFIG}:quick",
    f"--workdir={tmp_path}",
    "--config.slots=256",
    "--config.classes.count.length_cv=0.3",
    "--config.num_steps=6",
    "--config.compare_scheduling=False",
    "--config.compare_adoption=False",
    "--config.sweep=()",
    "--config.speed_trajectories=0",
  ]
  env = dict(os.environ, PYTHONPATH=str(_ROOT))
  proc = subprocess.run(cmd, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "reduction" in proc.stdout
  saved = json.loads((tmp_path / "staleness.json").read_text())
  assert saved["workload"]["slots"] == 256
  assert saved["workload"]["classes"][1]["length_cv"] == 0.3
  assert saved["sweep"] == [] and "speed" not in saved


def test_paper_variant_and_its_sweep_are_feasible_workloads():
  """`:paper` (M = 16) keeps its quotas feasible in every sweep variant; the run is a benchmark."""
  from lab.bench.staleness import with_overrides, workload_from_config

  config = staleness_config.get_config("paper")
  w = workload_from_config(config)
  assert (w.minibatches, config.slots, w.groups_per_step * w.group_size) == (16, 128, 1024)
  for _name, overrides in config.sweep:
    workload_from_config(with_overrides(config, overrides))  # raises on infeasible quotas
  assert [n for n, _ in config.sweep if n.startswith("heldout")] == [
    "heldout_math_cv_0.5",
    "heldout_mix_56_8",
  ]
