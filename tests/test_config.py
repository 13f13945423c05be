"""Config validation of PPO with a critic and of the KL as a reward (one sentence per error)."""

import dataclasses

import pytest

from configs import arith_tiny, count_vlm_tiny
from knitjax.config import from_config_dict
from tests import tiny


def _arith(variant="quick", **train):
  c = arith_tiny.get_config(variant)
  tiny.set_fields(c, **train)
  return c


def test_gae_gives_the_policy_a_value_head_and_only_gae_does():
  assert from_config_dict(arith_tiny.get_config("ppo,quick")).model.value_head
  assert not from_config_dict(arith_tiny.get_config("quick")).model.value_head
  assert not from_config_dict(arith_tiny.get_config("kl_reward,quick")).model.value_head


@pytest.mark.parametrize(
  "train, match",
  [
    (dict(advantage="ppo"), r"config.loss.advantage='ppo' is not accepted; choose one of: "
     r"grpo, drgrpo, rloo, gae"),
    (dict(kl_penalty="advantage"), r"config.loss.kl_penalty='advantage' is not accepted"),
    (dict(kl_penalty="reward"), r"kl_penalty='reward' is not accepted with config.loss.kl_coef=0"),
    (dict(gamma=1.5), r"config.critic.gamma=1.5 is not accepted; it must be in \[0, 1\]"),
    (dict(gae_lambda=-0.1), r"config.critic.gae_lambda=-0.1 is not accepted"),
    (dict(advantage="gae", value_coef=0.0), r"config.critic.value_coef=0.0 is not accepted; it "
     r"must be > 0"),
    (dict(value_clip=-0.2), r"config.critic.value_clip=-0.2 is not accepted; it must be >= 0"),
  ],
)  # fmt: skip
def test_bad_ppo_fields_are_one_sentence(train, match):
  with pytest.raises(ValueError, match=match):
    from_config_dict(_arith(**train))


@pytest.mark.parametrize("train", [dict(advantage="gae"), dict(kl_coef=0.1, kl_penalty="reward")])
def test_a_vlm_refuses_in_step_advantages(train):
  c = count_vlm_tiny.get_config("quick")
  tiny.set_fields(c, **train)
  with pytest.raises(ValueError, match="is not accepted with a VLM"):
    from_config_dict(c)


def test_unknown_arith_variant():
  with pytest.raises(ValueError, match=r"unknown variant \['pop'\]"):
    arith_tiny.get_config("ppo,pop")


@pytest.mark.parametrize(
  "section, field, value, match",
  [
    ("rollout", "group_size", 10**12, "at most 1,048,576"),
    ("rollout", "slots", 10**12, "at most 1,048,576"),
    ("rollout", "decode_steps", 10**12, "at most 1,048,576"),
    ("rollout", "refill_groups", 10**12, "at most 1,048,576"),
    ("rollout", "max_new_tokens", 10**12, "at most 1,048,576"),
    ("rollout", "prefill_chunk", 10**12, "at most 1,048,576"),
    ("task", "prompt_len", 10**12, "at most 1,048,576"),
    ("mesh", "cpu_devices", 100000, "at most 1,024"),
    ("loop", "steps", 10**12, "at most 2,147,483,647"),
    ("checkpoint", "every_steps", 10**12, "at most 2,147,483,647"),
    ("eval", "prompts", 10**12, "at most 1,048,576"),
    ("layout", "micro_batches", 10**12, "at most 1,048,576"),
    ("admission", "minibatches", 10**12, "at most 1,048,576"),
  ],
)
def test_absurd_counts_are_one_sentence_with_the_limit(section, field, value, match):
  c = _arith()
  c[section][field] = value
  with pytest.raises(ValueError, match=rf"^config\.{section}\.{field}={value} is not accepted; "
                     rf"it must be {match}\.$"):  # fmt: skip
    from_config_dict(c)


@pytest.mark.parametrize("temperature", [0.0, 1e-39, -1.0])
def test_temperatures_the_trainer_cannot_divide_by_are_refused(temperature):
  c = _arith()
  c.rollout.temperature = temperature
  with pytest.raises(
    ValueError, match=r"config\.rollout\.temperature=.* must be at least 1\.18e-38"
  ):
    from_config_dict(c)


@pytest.mark.parametrize("temperature", [1e-6, 0.01, 0.1, 2.0])
def test_small_temperatures_are_accepted(temperature):
  c = _arith()
  c.rollout.temperature = temperature
  assert from_config_dict(c).rollout.temperature == temperature


def test_token_budgets_must_fit_the_checkpoint_positions():
  import os

  folder = os.path.join(os.path.dirname(__file__), "models", "data", "hf_llama")  # 128 positions
  c = _arith()
  c.init_from = folder
  c.rollout.max_new_tokens = 127
  assert from_config_dict(c).rollout.max_new_tokens == 127
  c.rollout.max_new_tokens = 128
  with pytest.raises(
    ValueError,
    match=r"^config.rollout.max_new_tokens=128 is not accepted; prompt and response must fit the "
    r"model's 128 positions \(max_position_embeddings in .*hf_llama/config.json\)\.$",
  ):
    from_config_dict(c)
  c.rollout.max_new_tokens = 100
  c.task.prompt_len = 29
  with pytest.raises(ValueError, match=r"max_new_tokens=100 is not accepted with config.task"):
    from_config_dict(c)


@pytest.mark.parametrize(
  "old, new",
  [
    ("train.lr", "config.train.lr is now config.optimizer.lr."),
    ("train.packing", "config.train.packing is now config.layout.packing."),
    ("runtime.steps", "config.runtime.steps is now config.loop.steps."),
    ("runtime.param_slots", "config.runtime.param_slots is now config.sync.held_versions."),
    ("runtime.mode", "config.runtime.mode is now config.topology.mode."),
  ],
)
def test_an_old_name_is_one_sentence_naming_the_new_one(old, new):
  section, field = old.split(".")
  c = arith_tiny.get_config("quick").to_dict()
  c[section] = {field: 1}
  with pytest.raises(ValueError) as e:
    from_config_dict(c)
  assert str(e.value) == new


def test_every_old_field_has_a_home():
  from knitjax.config import RENAMED, SECTIONS

  for old, new in RENAMED.items():
    section, field = new.split(".")
    assert field in {f.name for f in dataclasses.fields(SECTIONS[section])}, old


@pytest.mark.parametrize("old", ["topology.rollout_hosts", "runtime.rollout_listen"])
def test_a_retired_field_is_one_sentence_saying_what_replaced_it(old):
  """Rollout hosts went (issue 45): their fields name Ray's, in the file and on the command line."""
  from knitjax import cli
  from knitjax.config import RETIRED, SECTIONS

  section, field = old.split(".")
  c = arith_tiny.get_config("quick").to_dict()
  c[section] = {**c.get(section, {}), field: 1}
  with pytest.raises(
    ValueError, match=r"went with rollout hosts .*\(config.topology.rollout_workers"
  ):
    from_config_dict(c)
  assert cli._renamed_override(f"--config.{old}=1").startswith(f"config.{old} went with")
  for name in RETIRED:  # none of them is a field any more
    s, f = name.split(".")
    assert s not in SECTIONS or f not in {x.name for x in dataclasses.fields(SECTIONS[s])}


def test_a_group_estimator_with_one_response_a_group_is_refused():
  """group_size=1 under GRPO trained on all-zero advantages without a word (issue 47)."""
  c = arith_tiny.get_config("quick")
  c.rollout.group_size = 1
  c.admission.quotas = {"arith": 8}
  c.admission.minibatches = 1
  with pytest.raises(ValueError, match=r"config.rollout.group_size=1 gives every response"):
    from_config_dict(c)
