"""configs/calc_tool_tiny.py: the multi-turn rollout's config checks, and 2-step smoke runs in
colocated and disaggregated mode."""

import json
import re

import pytest

from configs import arith_tiny, calc_tool_tiny
from knitjax.config import from_config_dict
from knitjax.run import train


def test_auto_picks_the_multiturn_rollout_for_a_task_with_an_environment():
  for variant in ("", "disagg"):
    cfg = from_config_dict(calc_tool_tiny.get_config(variant))
    assert cfg.rollout.engine == "multiturn"
    assert (cfg.rollout.max_turns, cfg.rollout.turn_tokens, cfg.rollout.max_new_tokens) == (
      3,
      6,
      16,
    )
  assert from_config_dict(arith_tiny.get_config()).rollout.engine == "batched"


@pytest.mark.parametrize(
  "base, field, value, expected",
  [
    ("calc", "rollout.engine", "batched", "config.rollout.engine='batched' does not fit"),
    ("calc", "rollout.engine", "continuous", "engine 'multiturn' (or 'auto') runs exactly"),
    ("arith", "rollout.engine", "multiturn", "does not fit config.task.name='arith'"),
    ("arith", "rollout.max_turns", 2, "apply to config.rollout.engine='multiturn' only"),
    ("calc", "rollout.max_turns", 0, "config.rollout.max_turns"),
    ("calc", "rollout.turn_tokens", 17, "config.rollout.turn_tokens=17 is not accepted"),
    ("calc", "task.reward", "arith_exact", "config.task.reward='arith_exact' is not accepted"),
    ("calc", "eval.every_steps", 10, "config.eval.every_steps is not accepted with"),
    ("calc", "rollout.class_max_new_tokens", {"calc": 4}, "class_max_new_tokens is not accepted"),
  ],
)
def test_bad_multiturn_config_names_the_field(base, field, value, expected):
  c = (calc_tool_tiny if base == "calc" else arith_tiny).get_config().to_dict()
  section, key = field.split(".")
  c[section][key] = value
  with pytest.raises(ValueError, match=re.escape(expected)):
    from_config_dict(c)


def _rows(workdir):
  with open(workdir / "metrics.jsonl") as f:
    return [json.loads(line) for line in f if line.strip()]


def test_colocated_quick_run(tmp_path):
  cfg = from_config_dict(calc_tool_tiny.get_config("quick"))
  train(cfg, str(tmp_path))
  rows = _rows(tmp_path)
  assert [r["step"] for r in rows] == [1, 2] and [r["version"] for r in rows] == [1, 2]
  for r in rows:  # rewards from the environment; some samples end a turn with '=' (a call)
    assert 0.0 <= r["reward_mean"] <= 1.0 and 0.0 <= r["env_token_rows"] <= 1.0
    assert r["staleness_mean"] == 0 and r["solved_fraction"] <= r["reward_mean"] + 1e-6
  assert any(r["env_token_rows"] > 0 for r in rows)


def test_disaggregated_quick_run(tmp_path):
  c = calc_tool_tiny.get_config("disagg_quick")
  c.topology.rollout_devices = 4  # the test session has 8 devices: 4 sample, 4 train
  cfg = from_config_dict(c)
  assert cfg.topology.mode == "disaggregated" and cfg.admission.minibatches == 2
  train(cfg, str(tmp_path))
  rows = _rows(tmp_path)
  assert [r["step"] for r in rows] == [1, 2] and [r["version"] for r in rows] == [2, 4]
  assert rows[-1]["groups_lost"] == 0 and rows[-1]["groups_consumed"] == 8
  assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
  with open(tmp_path / "consumed.jsonl") as f:
    consumed = [json.loads(line) for line in f if line.strip()]
  assert [(c["step"], c["index"]) for c in consumed] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  assert all(v <= c["consume_version"] for c in consumed for v in c["gen_versions"])


@pytest.fixture
def local_ray():
  ray = pytest.importorskip("ray")
  if ray.is_initialized():  # another test of this worker process left its Ray running
    ray.shutdown()
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=1 << 28)
  yield
  ray.shutdown()


def test_colocated_quick_run_with_a_ray_rollout_worker(local_ray, tmp_path):
  """The multi-turn rollout inside a Ray actor (HostedRollout drives it turn by turn)."""
  c = calc_tool_tiny.get_config("quick")
  c.topology.rollout_workers = 1
  train(from_config_dict(c), str(tmp_path))
  rows = _rows(tmp_path)
  assert [r["version"] for r in rows] == [1, 2]
  assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
  assert any(r["env_token_rows"] > 0 for r in rows)
