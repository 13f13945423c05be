"""The admission benchmark's quick variant runs and writes a complete, consistent JSON."""

import importlib.util
import json
import os
import pathlib

import pytest

from lab.bench import admission

_CONFIG = pathlib.Path(__file__).parents[3] / "configs" / "bench" / "admission.py"
_spec = importlib.util.spec_from_file_location("admission_config", _CONFIG)
admission_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(admission_config)


def test_quick_run_writes_json_and_plot(tmp_path):
  config = admission_config.get_config("quick")
  result = admission.run(config, str(tmp_path))
  with open(tmp_path / "admission.json") as f:
    saved = json.load(f)
  assert saved == json.loads(json.dumps(result))
  assert os.path.getsize(tmp_path / "admission.png") > 0
  assert saved["workload"]["num_groups"] == 200
  assert saved["workload"]["groups_per_step"] == 8
  assert set(saved["results"]) == {"minibatch", "train_batch", "greedy"}
  for policy, r in saved["results"].items():
    assert 0 < r["median_us"] <= r["p99_us"] <= r["max_us"], policy
    assert r["released_groups"] + r["pending_at_end"] == 200, policy
    assert r["released_groups"] == r["released_steps"] * 8, policy
  for policy in ("minibatch", "train_batch"):
    r = saved["results"][policy]
    assert (r["quota_violations"], r["bound_violations"], r["stalls"]) == (0, 0, 0)
    assert r["released_steps"] == 200 // 8  # "steps" arrivals: exactly 25 steps' worth
  assert (
    saved["results"]["minibatch"]["admission_delay_offers_mean"]
    < saved["results"]["train_batch"]["admission_delay_offers_mean"]
  )
  assert saved["goal_met"] == (saved["results"]["minibatch"]["median_us"] <= 50.0)


def test_bad_variant_and_policy_are_named(tmp_path):
  with pytest.raises(ValueError, match="no variant 'huge'"):
    admission_config.get_config("huge")
  config = admission_config.get_config("quick")
  config.policies = ("fifo",)
  with pytest.raises(ValueError, match="'fifo'"):
    admission.run(config, str(tmp_path))


@pytest.mark.parametrize(
  "field, value, least",
  [("repeats", 0, 1), ("num_groups", -5, 1), ("seed", -1, 0), ("num_classes", 0, 1)],
)
def test_bad_counts_name_the_field_and_what_is_accepted(field, value, least):
  config = admission_config.get_config("quick")
  config[field] = value
  with pytest.raises(ValueError) as e:
    admission.check_config(config)
  assert str(e.value) == (
    f"admission bench: config.{field}={value} is not accepted; give an integer >= {least}."
  )
  admission.check_config(admission_config.get_config("quick"))
