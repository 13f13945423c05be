"""The engine benchmark: every rollout generates every sample; the stall fit is calibration's."""

import json

import numpy as np
import pytest

from configs.bench import engine as engine_config
from knitjax.sim.calibration import engine_call_fit
from lab.bench import engine


def test_quick_run_generates_every_sample_in_each_rollout(tmp_path):
  config = engine_config.get_config("quick")
  out = engine.run(config, str(tmp_path))
  with open(tmp_path / "engine.json") as f:
    assert json.load(f) == json.loads(json.dumps(out))
  assert (tmp_path / "engine.png").exists()
  samples = config.groups * config.group_size
  ro = out["rollouts"]
  rollouts = engine.ROLLOUTS + engine.VERSIONED
  assert {w: e["samples"] for w, e in ro.items()} == dict.fromkeys(rollouts, samples)
  # One prefill per group with prefix sharing (each group fits one shard), one per sample before.
  assert ro["engine"]["prefills"] == config.groups
  assert ro["before"]["prefills"] == samples
  assert ro["engine"]["chunk_passes"] > 0
  # Version transitions: the split engine never computes more rows than one pass per version.
  split, unsplit = ro["versions_split"], ro["versions_unsplit"]
  assert split["rows_decoded"] <= split["rows_unsplit"]
  assert unsplit["rows_decoded"] == unsplit["rows_unsplit"]
  assert out["engine_vs_before"] == pytest.approx(
    ro["engine"]["tokens_per_s"] / ro["before"]["tokens_per_s"]
  )


def test_stall_fit_recovers_known_costs():
  """Calls timed as 1 ms + 2 ms per decode pass + 5 ms per chunk pass: the fit finds 2 ms per
  iteration and charges the rest (the chunks and the intercept) to the groups started."""
  rng = np.random.default_rng(0)
  rows = []
  for k in range(50):
    decode, chunks, starts = int(rng.integers(1, 9)), int(rng.integers(0, 4)), int(k % 3 == 0)
    rows.append((k, 0.001 + 0.002 * decode + 0.005 * chunks, decode, starts, 8, chunks, decode))
  calls = np.asarray(rows, np.float64)
  fit = engine_call_fit(calls)
  assert fit["decode_s_per_iteration"] == pytest.approx(0.002, rel=1e-6)
  rest = calls[:, 1].sum() - 0.002 * calls[:, 6].sum()
  assert fit["group_start_s"] == pytest.approx(rest / calls[:, 3].sum(), rel=1e-6)
  assert fit["group_start_stall_fraction"] == pytest.approx(rest / calls[:, 1].sum(), rel=1e-6)
  assert fit["chunk_passes"] == int(calls[:, 5].sum())
