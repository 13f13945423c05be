"""The real staleness benchmark's quick variant: real runs, simulated prediction, learning files."""

import importlib.util
import json
import os
import pathlib

import pytest

from knitjax.bench import staleness_real
from knitjax.sim.frontier import compare

_ROOT = pathlib.Path(__file__).parents[2]
_spec = importlib.util.spec_from_file_location(
  "staleness_real_config", _ROOT / "configs" / "bench" / "staleness_real.py"
)
staleness_real_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(staleness_real_config)


@pytest.mark.slow
def test_quick_variant_measures_predicts_and_writes_learning(tmp_path):
  config = staleness_real_config.get_config("quick")
  staleness_real.run(config, str(tmp_path))
  saved = json.loads((tmp_path / "staleness_real.json").read_text())
  assert set(saved["policies"]) == {"colocated", "train_batch", "minibatch"}
  for policy in ("train_batch", "minibatch"):
    pts = saved["frontier"][policy]
    assert [p["max_lag_steps"] for p in pts] == [0.0, 1.0]
    for p in pts:
      assert p["steps_per_hour"] > 0 and p["arch_staleness_mean"] >= 0
      assert p["quota_violations"] == 0 and p["groups_lost"] == 0
    # Depth 0: rollout never runs ahead, so nothing is staler than colocated execution.
    assert pts[0]["arch_staleness_max"] == 0
  assert saved["frontier"]["colocated"][0]["arch_staleness_max"] == 0
  cmp = compare(saved["frontier"]["train_batch"], saved["frontier"]["minibatch"], depth=1.0)
  assert saved["throughput_gain"] == pytest.approx(cmp["throughput_gain"])
  assert saved["reduction"] == cmp["reduction"]
  # Every point has the simulator's prediction and the relative differences.
  assert set(saved["rel_error"]) == {
    "colocated",
    "train_batch_d0",
    "train_batch_d1",
    "minibatch_d0",
    "minibatch_d1",
  }
  for key, err in saved["rel_error"].items():
    pred = next(
      p
      for pts in saved["predicted"]["frontier"].values()
      for p in pts
      if p["max_lag_steps"] == err["max_lag_steps"]
    )
    assert pred["steps_per_hour"] > 0, key
  assert saved["checks"]["quota_violations_all_runs"] == 0
  learning = json.loads((tmp_path / "learning.json").read_text())
  assert set(learning["curves"]) == {"colocated", "train_batch", "minibatch"}
  assert learning["version_budget"] == pytest.approx(1.1 * learning["colocated_versions"])
  assert os.path.getsize(tmp_path / "learning.png") > 10_000
  assert os.path.getsize(tmp_path / "staleness_real.png") > 10_000
