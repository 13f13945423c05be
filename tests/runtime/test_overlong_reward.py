"""DAPO's overlong penalty reaches the rewards training rollouts store, and only those."""

import jax
import numpy as np
import pytest

from configs import arith_tiny
from knitjax.config import from_config_dict
from knitjax.distributed.topology import choose
from knitjax.rollout.contract import generate
from knitjax.runtime import builder, rollout_builder
from knitjax.tasks.rewards import get_reward_fn
from knitjax.train.reward_shaping import overlong_penalty, with_overlong_penalty


def _config(buffer, engine="batched"):
  c = arith_tiny.get_config()
  c.rollout.group_size = 4
  c.rollout.max_new_tokens = 6
  c.rollout.overlong_buffer = buffer
  c.rollout.engine = engine
  c.rollout.slots = 16
  return from_config_dict(c)


@pytest.mark.parametrize("engine", ["batched", "continuous"])
def test_training_rollouts_store_verifier_plus_penalty(engine):
  config = _config(3, engine)
  mesh = builder.build_mesh(config)
  prompts = builder.build_prompts(config)
  graphdef, params = builder.build_model(config, mesh)
  rollout = choose(config).rollout(config, graphdef, mesh, prompts)
  batch = prompts.next({"arith": 4})
  metas = generate(rollout, params, batch, version=0, rng=jax.random.key(1), first_group_id=0)
  verifier = get_reward_fn(config.task.reward)
  unit = rollout.storage[metas[0].storage_unit]
  penalised = 0
  for meta, prompt in zip(metas, batch, strict=True):
    payload = unit.get([meta.group_id])[0]
    for k in range(4):
      n = int(payload.response_lengths[k])
      ids = payload.response_tokens[k, :n]
      want = verifier(prompt, ids, prompts.tokenizer) + overlong_penalty(n, 6, 3)
      np.testing.assert_allclose(payload.rewards[k], want, rtol=0, atol=1e-6)
      penalised += n > 3
  assert penalised > 0  # a random policy runs long: the penalty was exercised
  rollout.close()


def test_evaluation_scores_the_verifier_alone():
  config = _config(3)
  verifier = get_reward_fn(config.task.reward)
  assert rollout_builder.training_reward(_config(0)) is verifier
  assert rollout_builder.training_reward(config) is not verifier
  mesh = builder.build_mesh(config)
  prompts = builder.build_prompts(config)
  graphdef, _ = builder.build_model(config, mesh)
  evaluator = rollout_builder.build_evaluator(config, graphdef, mesh, prompts)
  # private, but the point: neither the evaluator nor its sampler workers shape rewards
  assert evaluator._reward_fn is verifier
  assert evaluator._greedy._reward_fn is verifier


def test_class_budgets_set_each_prompts_ramp():
  class P:
    cls = "short"

  fn = with_overlong_penalty(
    lambda p, ids, tok: 1.0, max_new_tokens=10, class_max_new_tokens={"short": 4}, buffer=2
  )
  assert fn(P(), np.zeros(3, np.int32), None) == pytest.approx(0.5)  # (4 - 2 - 3) / 2 = -0.5
  P.cls = "long"
  assert fn(P(), np.zeros(3, np.int32), None) == 1.0


def test_a_buffer_longer_than_a_budget_is_refused():
  c = arith_tiny.get_config()
  c.rollout.max_new_tokens = 4
  c.rollout.overlong_buffer = 5
  with pytest.raises(ValueError, match="overlong_buffer=5"):
    from_config_dict(c)
