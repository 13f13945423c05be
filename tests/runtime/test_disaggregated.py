"""Disaggregated runtime end to end on 8 fake devices (4 rollout, 4 train)."""

import collections
import json
import os

import pytest

from configs import arith_disagg
from knitjax.config import from_config_dict
from knitjax.distributed.in_process import split_devices
from knitjax.rollout import versions
from knitjax.run import train
from lab.bench import group_times, rollout_summary
from tests import tiny


def quick_config(**runtime):
  c = arith_disagg.get_config("quick")
  tiny.set_fields(c, **runtime)
  return c


def read_jsonl(workdir, name):
  with open(os.path.join(workdir, name)) as f:
    return [json.loads(line) for line in f if line.strip()]


def check_run(workdir, config):
  """Invariants every disaggregated run must meet; returns the metric rows."""
  cfg = from_config_dict(config)
  quotas, m = dict(cfg.admission.quotas), cfg.admission.minibatches
  lo, hi = cfg.admission.min_per_minibatch, cfg.admission.max_per_minibatch
  rows = read_jsonl(workdir, "metrics.jsonl")
  consumed = read_jsonl(workdir, "consumed.jsonl")
  offered = read_jsonl(workdir, "offered.jsonl")
  assert [r["step"] for r in rows] == list(range(1, cfg.loop.steps + 1))
  # Versions advance: M updates per step; the rollout follows the published versions.
  assert [r["version"] for r in rows] == [m * s for s in range(1, cfg.loop.steps + 1)]
  assert rows[-1]["rollout_version"] >= 1
  # Mini-batches in (step, index) order, consumed at consecutive versions.
  assert [(c["step"], c["index"]) for c in consumed] == [
    (s, j) for s in range(cfg.loop.steps) for j in range(m)
  ]
  assert [c["consume_version"] for c in consumed] == list(range(len(consumed)))
  per_step = collections.defaultdict(collections.Counter)
  for c in consumed:
    counts = collections.Counter(c["classes"])
    for cls in quotas:  # every released mini-batch satisfies the per-mini-batch bounds
      assert lo.get(cls, 0) <= counts[cls] <= hi.get(cls, 10**9), c
    per_step[c["step"]].update(counts)
    assert all(v <= c["consume_version"] for v in c["gen_versions"])
  assert all(dict(per_step[s]) == quotas for s in per_step)  # and every step its quotas
  # Each group's wall times: started before offered, offered before the update that used it.
  t_offer = {o["group_id"]: o["t_offer"] for o in offered}
  assert all(o["t_start"] is None or o["t_start"] <= o["t_offer"] for o in offered)
  assert all(c["t"] >= t_offer[g] for c in consumed for g in c["group_ids"])
  # Generation used versions past 0 (weights were synced) and lagged by at most the depth.
  gen = [v for c in consumed for v in c["gen_versions"]]
  assert max(gen) >= 1
  # No group lost: offered = consumed + rejected + pending, at every step, and by id.
  for r in rows:
    assert r["groups_lost"] == 0 and r["quota_violations"] == 0
    assert r["groups_offered"] == r["groups_consumed"] + r["groups_rejected"] + r["groups_pending"]
  ids = [g for c in consumed for g in c["group_ids"]]
  assert len(ids) == len(set(ids))  # none consumed twice
  offered_ids = {o["group_id"] for o in offered}
  assert len(offered_ids) == len(offered) == rows[-1]["groups_offered"]
  assert set(ids) <= offered_ids
  assert len(ids) == rows[-1]["groups_consumed"]
  for key in ("staleness_mean", "arch_staleness_p99", "rollout_busy_fraction", "tokens_per_s"):
    assert rows[-1][key] is not None
  return rows


def test_quick_run_versions_quotas_and_conservation(tmp_path):
  config = quick_config()
  train(from_config_dict(config), str(tmp_path))
  rows = check_run(str(tmp_path), config)
  summary = rollout_summary.summarize(str(tmp_path), warmup_steps=1)
  assert summary["steps_per_hour"] > 0 and summary["engine_calls"] > 0
  assert summary["groups_started"] > 0 and summary["decode_s_per_iteration"] > 0
  # The parts of the groups' staleness add up to it, in the run and in the simulator.
  parts = group_times.measured(str(tmp_path), warmup_steps=1)
  later = [c for c in read_jsonl(str(tmp_path), "consumed.jsonl") if c["step"] >= 1]
  gaps = [c["consume_version"] - g for c in later for g in c["gen_versions"]]
  assert parts["groups"] == len(gaps)
  total = parts["label_lag"] + parts["start_to_offer"] + parts["offer_to_consume"]
  assert total == pytest.approx(sum(gaps) / len(gaps))
  assert set(parts["start_to_offer_s"]) == {"arith", "think"}
  cfg_file = tmp_path / "run_config.py"
  cfg_file.write_text(
    "import json\nimport ml_collections\n\ndef get_config(arg=None):\n"
    f"  return ml_collections.ConfigDict(json.loads({json.dumps(config.to_dict())!r}))\n"
  )
  sim = group_times.simulated(str(tmp_path), str(cfg_file), warmup_steps=1, seeds=(0,))
  assert sim["groups"] > 0 and sim["start_to_offer"] >= 0 and sim["offer_to_consume"] >= 0
  assert "simulator" in group_times.table({"run": parts, "simulator": sim})
  timings = json.loads((tmp_path / "timings.json").read_text())
  assert timings["calls"] and len(timings["trainer_minibatch_s"]) == 2 * 3
  assert set(timings["lengths"]) == {"arith", "think"}
  assert all(1 <= n <= 4 for n in timings["lengths"]["arith"])
  assert rows[-1]["reward_mean"] is not None and os.path.exists(tmp_path / "reward.png")
  # Weight sync: float32 model, so float32 on the wire; the trainer is held only for dispatch.
  assert (timings["weight_sync_dtype"], timings["weight_sync_publish"]) == ("float32", "async")
  assert sum(r["weight_publish_s"] for r in rows) > 0
  assert timings["weight_publish_blocked_s_mean"] > 0
  assert timings["weight_publish_bytes_mean"] == max(r["weight_publish_bytes"] for r in rows) > 0


def test_train_batch_step_sync_and_partial_rollout(tmp_path):
  config = quick_config(every="step", adoption="mid_generation", max_lag_steps=0.5)
  config.admission.policy = "train_batch"
  train(from_config_dict(config), str(tmp_path))
  rows = check_run(str(tmp_path), config)
  # Weights are published once per step: the rollout only ever holds step-boundary versions.
  consumed = read_jsonl(str(tmp_path), "consumed.jsonl")
  assert {v % 2 for c in consumed for v in c["gen_versions"]} == {0}
  assert rows[-1]["rollout_version"] % 2 == 0


def test_depth_bound_and_device_split():
  assert versions.lag_groups(1.0, groups_per_step=8, minibatches=2) == 8
  assert versions.lag_groups(0.5, groups_per_step=8, minibatches=2) == 4
  with pytest.raises(ValueError, match="multiple of 1/M = 1/2"):
    versions.lag_groups(0.3, groups_per_step=8, minibatches=2)
  clock = versions.VersionClock(0, groups_per_step=8, minibatches=2, max_lag_steps=0.5)
  assert clock.limit() == 8 + 4
  clock.advance(2)  # one step done
  assert clock.limit() == 16 + 4
  clock = versions.VersionClock(
    1, groups_per_step=8, minibatches=2, max_lag_steps=0.5, lag_unit="minibatch"
  )
  assert clock.limit() == 8 + 4 + 4  # one mini-batch consumed: its 4 groups come back
  clock.advance(2)
  assert clock.limit() == 16 + 4  # at a step boundary both units agree
  # Groups start on the rollout's adopted weights: a version published after they were adopted
  # (an asynchronous or Ray publish) does not deepen the bound for them (the network fault
  # trials saw 8-24 groups a run start one version too deep before).
  assert clock.limit(weights_version=1) == 8 + 4 + 4 and clock.limit(weights_version=5) == 20
  with pytest.raises(ValueError, match="lag_unit='version'"):
    versions.VersionClock(0, groups_per_step=8, minibatches=2, max_lag_steps=0, lag_unit="version")
  # the clock's constants sit beside it: config and the simulator check lag units against them
  from knitjax import config_run
  from knitjax.sim import workload

  assert versions.LAG_UNITS == ("step", "minibatch")
  assert config_run.LAG_UNITS is versions.LAG_UNITS and workload.LAG_UNITS is versions.LAG_UNITS
  cfg = from_config_dict(quick_config(rollout_devices=3))
  rollout, trainer = split_devices(cfg, devices=list(range(8)))
  assert rollout == [0, 1, 2] and trainer == [3, 4, 5, 6, 7]
  with pytest.raises(ValueError, match="leaves no devices"):
    split_devices(from_config_dict(quick_config(rollout_devices=8)), devices=list(range(8)))


@pytest.mark.parametrize("transfer", ["on_demand", "centralized"])
def test_vlm_runs_disaggregated_through_the_batched_rollout(tmp_path, transfer):
  """A VLM policy in disaggregated mode: same contract, images stored once, encoder dedup;
  the centralized baseline hands the trainer every row's own image copy instead."""
  from configs import count_vlm_tiny

  c = count_vlm_tiny.get_config("quick")
  tiny.set_fields(c, mode="disaggregated", steps=2, max_lag_steps=0.5)
  c.admission.update(quotas={"count": 8}, minibatches=2)
  c.rollout.slots = 4 * c.rollout.group_size  # waves of 4 groups
  c.transfer = {"mode": transfer}
  cfg = from_config_dict(c)
  assert cfg.rollout.engine == "batched"
  train(cfg, str(tmp_path))
  rows = check_run(str(tmp_path), c)
  # Each mini-batch's 4 groups bring 4 images, each encoded once; centralized: 32 row copies.
  images = 4 if transfer == "on_demand" else 4 * c.rollout.group_size
  for r in rows:
    assert r["unique_images"] == images
    assert r["encoder_images_encoded"] == images and r["encoder_backward_passes"] == 1


def test_text_runs_disaggregated_with_the_batched_sampler(tmp_path):
  config = quick_config()
  config.rollout.engine = "batched"
  train(from_config_dict(config), str(tmp_path))
  check_run(str(tmp_path), config)


def test_the_other_mode_cannot_resume_a_workdir(tmp_path):
  """Resuming a colocated workdir in disaggregated mode (or back) is refused, not dropped."""
  from configs import arith_tiny

  c = arith_tiny.get_config("quick")
  c.loop.steps = 1
  train(from_config_dict(c), str(tmp_path))
  tiny.set_fields(c, mode="disaggregated", steps=2)
  with pytest.raises(ValueError, match="come from a colocated run"):
    train(from_config_dict(c), str(tmp_path))


def test_vlm_with_the_continuous_engine_is_one_clear_error():
  from configs import count_vlm_tiny

  c = count_vlm_tiny.get_config("quick")
  c.topology.mode = "disaggregated"
  c.rollout.engine = "continuous"
  with pytest.raises(ValueError, match="needs config.rollout.engine='batched'"):
    from_config_dict(c)
