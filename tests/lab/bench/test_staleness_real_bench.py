"""The real staleness benchmark's quick variant: real runs, simulated prediction, learning files."""

import importlib.util
import json
import os
import pathlib

import pytest

from lab.bench import staleness_real

_ROOT = pathlib.Path(__file__).parents[3]
_spec = importlib.util.spec_from_file_location(
  "staleness_real_config", _ROOT / "configs" / "bench" / "staleness_real.py"
)
staleness_real_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(staleness_real_config)


def _at(points, depth):
  (p,) = [p for p in points if p["max_lag_steps"] == depth]
  return p


def _rel(predicted, measured):
  """(predicted - measured) / measured; no error when both are 0."""
  return 0.0 if predicted == measured == 0 else (predicted - measured) / measured


def check_saved(saved, tolerance):
  """Checks the benchmark's JSON against arithmetic redone here from its own points."""
  assert set(saved["policies"]) == {"colocated", "train_batch", "minibatch"}
  frontier = saved["frontier"]
  for policy in ("train_batch", "minibatch"):
    pts = frontier[policy]
    assert [p["max_lag_steps"] for p in pts] == [0.0, 1.0]
    for p in pts:
      assert p["steps_per_hour"] > 0 and p["arch_staleness_mean"] >= 0
      assert p["quota_violations"] == 0 and p["groups_lost"] == 0
    # Depth 0: rollout never runs ahead, so nothing is staler than colocated execution.
    assert pts[0]["arch_staleness_max"] == 0
  assert frontier["colocated"][0]["arch_staleness_max"] == 0
  # The headline comparison at depth 1, from the frontier points: throughput ratio, and the arch
  # staleness cut at the shallowest minibatch depth with at least train_batch's throughput.
  base, cand = _at(frontier["train_batch"], 1.0), _at(frontier["minibatch"], 1.0)
  assert saved["policies"]["train_batch"] == base and saved["policies"]["minibatch"] == cand
  assert saved["throughput_gain"] == pytest.approx(cand["steps_per_hour"] / base["steps_per_hour"])
  matched = next(
    (p for p in frontier["minibatch"] if p["steps_per_hour"] >= base["steps_per_hour"]), None
  )
  if matched is None or base["arch_staleness_mean"] == 0:
    assert saved["reduction"] is None
  else:
    want = 1 - matched["arch_staleness_mean"] / base["arch_staleness_mean"]
    assert saved["reduction"] == pytest.approx(want)
  if base["arch_staleness_mean"] > 0:  # both policies at the reference depth
    want = 1 - cand["arch_staleness_mean"] / base["arch_staleness_mean"]
    assert saved["reduction_equal_config"] == pytest.approx(want)
  for p in frontier["minibatch"] + frontier["train_batch"]:  # clamped >= unclamped
    assert p["arch_staleness_mean"] >= p["arch_staleness_unclamped_mean"] - 1e-9
  # Every point has the simulator's prediction, and the reported relative errors are those of
  # the measured and predicted points of the same policy and depth.
  assert set(saved["rel_error"]) == {
    "colocated",
    "train_batch_d0",
    "train_batch_d1",
    "minibatch_d0",
    "minibatch_d1",
  }
  worst = 0.0
  for key, err in saved["rel_error"].items():
    policy, depth = key.rsplit("_d", 1)[0], err["max_lag_steps"]
    m = _at(frontier[policy], depth)
    p = _at(saved["predicted"]["frontier"][policy], depth)
    assert p["steps_per_hour"] > 0, key
    for k in ("steps_per_hour", "arch_staleness_mean"):
      assert err[k] == pytest.approx(_rel(p[k], m[k])), (key, k)
      worst = max(worst, abs(err[k]))
    assert err["arch_staleness_abs_diff"] == pytest.approx(
      p["arch_staleness_mean"] - m["arch_staleness_mean"]
    )
    if depth == 0:  # nothing runs ahead at depth 0, measured or simulated: no staleness error
      assert err["arch_staleness_mean"] == 0, key
  assert saved["max_abs_rel_error"] == pytest.approx(worst)
  # The check the benchmark reports is the one computed from its points. Whether the simulator is
  # within +-20% at every point is a measured figure of real (timed) runs, so it belongs to the
  # benchmark (docs/disaggregated.md), not to a test: on a shared 2-core machine the tiny quick
  # runs' throughput can swing past it (CI, 2026-12-05: -20.5% at train_batch depth 1).
  assert saved["checks"]["tolerance"] == tolerance == 0.2
  assert saved["checks"]["prediction_within_tolerance"] == (worst <= tolerance)
  assert worst < 1.0, saved["rel_error"]  # still a prediction of the same runs
  assert saved["checks"]["quota_violations_all_runs"] == 0


def test_quick_variant_measures_predicts_and_writes_learning(tmp_path):
  config = staleness_real_config.get_config("quick")
  staleness_real.run(config, str(tmp_path))
  check_saved(json.loads((tmp_path / "staleness_real.json").read_text()), config.tolerance)
  learning = json.loads((tmp_path / "learning.json").read_text())
  assert set(learning["curves"]) == {"colocated", "train_batch", "minibatch"}
  assert learning["version_budget"] == pytest.approx(1.1 * learning["colocated_versions"])
  assert os.path.getsize(tmp_path / "learning.png") > 10_000
  assert os.path.getsize(tmp_path / "staleness_real.png") > 10_000
  # Judged again from the recorded runs (reuse_runs): nothing runs, the measurements are the same.
  saved = json.loads((tmp_path / "staleness_real.json").read_text())
  metrics = sorted(tmp_path.glob("runs/*/metrics.jsonl"))
  written = [p.stat().st_mtime_ns for p in metrics]
  config.reuse_runs = True
  again = staleness_real.run(config, str(tmp_path))
  assert [p.stat().st_mtime_ns for p in metrics] == written
  assert again["frontier"] == saved["frontier"]


def test_a_recorded_run_is_reused_only_for_the_same_config_and_all_its_steps(tmp_path):
  from lab.bench import real_runs

  config = staleness_real_config.get_config("quick").train
  name = "frontier_minibatch_d1_r0"
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / f"{name}.py").write_text(
    real_runs._CONFIG_FILE.format(name=name, payload=json.dumps(config.to_dict()))
  )
  run_dir = tmp_path / "runs" / name
  run_dir.mkdir(parents=True)
  (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {k}}}\n' for k in (1, 2, 3)))
  got = real_runs.reused(config, str(tmp_path), name, 3)
  assert got["workdir"] == str(run_dir) and got["command"].endswith(f"--workdir {run_dir}")
  assert real_runs.reused(config, str(tmp_path), name, 4) is None  # not finished
  assert real_runs.reused(config, str(tmp_path), "other", 3) is None
  config.optimizer.lr = config.optimizer.lr * 2
  assert real_runs.reused(config, str(tmp_path), name, 3) is None  # another config


def test_paper_variant_is_the_papers_regime_on_the_full_grid():
  from knitjax.config import from_config_dict

  config = staleness_real_config.get_config("paper")
  t = from_config_dict(config.train)
  b = sum(t.admission.quotas.values())
  assert t.admission.minibatches == 16
  assert b * t.rollout.group_size // t.rollout.slots == 8  # rollout waves per step
  # Quotas feasible at M = 16: one group of each class in every mini-batch.
  assert all(
    q == 16 and t.admission.min_per_minibatch[c] == 1 for c, q in t.admission.quotas.items()
  )
  assert config.depths == tuple(k / 16 for k in range(17))
  assert config.reference_depth in config.depths and config.learning_depth in config.depths
  assert staleness_real_config.get_config().depths == (0.0, 0.25, 0.5, 0.75, 1.0)


def test_in_a_cluster_a_disaggregated_run_generates_in_one_ray_actor_on_the_rollout_host():
  from knitjax.config import from_config_dict

  config = staleness_real_config.get_config("paper")
  config.cluster_link_mbit = 250.0
  args = dict(policy="minibatch", depth=1.0, steps=8, lr=1e-7)
  disagg = staleness_real._variant(config, mode="disaggregated", **args)
  colocated = staleness_real._variant(config, mode="colocated", **args)
  assert disagg.topology.rollout_workers == 1 and disagg.topology.ray_address == ""
  assert colocated.topology.rollout_workers == 0
  assert from_config_dict(disagg).topology.rollout_workers == 1  # a valid run
  config.cluster_link_mbit = 0.0  # no cluster: the rollout thread of the trainer's process
  assert staleness_real._variant(config, mode="disaggregated", **args).topology.rollout_workers == 0

  class Hosts:
    def spawn(self, host, argv, **popen):
      return host, argv, popen

  env = {"RAY_AUTH_MODE": "token"}
  host, argv, popen = staleness_real._spawn(Hosts(), env, "10.0.0.10:6379", 0, ["main"], env={})
  assert (host, argv, popen) == (
    0,
    ["main", "--config.topology.ray_address=10.0.0.10:6379"],
    {"env": env},
  )
  assert staleness_real._spawn(Hosts(), env, "", 2, ["main"])[:2] == (2, ["main"])
