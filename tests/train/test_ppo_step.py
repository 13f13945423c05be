"""PPO with a critic and the KL as a reward through the real train step: the micro-batch split
stays exact (the advantages are computed over the whole mini-batch before the scan)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from knitjax.train import advantages, losses, step_advantages
from knitjax.train.batch import make_batch, split_micro_batches
from knitjax.train.step import StepHParams
from knitjax.train.step_advantages import AdvantageConfig
from tests import tiny
from tests.tiny import N_NEW, P_LEN, ROWS, TINY

G = 4

# Compiled once per split (op-by-op dispatch of the eager function is the slow part on the CPU).
_compute = jax.jit(step_advantages.compute, static_argnames=("config", "kl_coef"))

MODES = {
  # gamma, lambda < 1 and a value clip; the KL a loss term.
  "gae": (AdvantageConfig(estimator="gae", gamma=0.95, gae_lambda=0.9), "loss"),
  "gae_kl_reward": (AdvantageConfig(estimator="gae", value_clip=None), "reward"),
  "grpo_kl_reward": (AdvantageConfig(estimator="grpo"), "reward"),
  "rloo_kl_reward": (AdvantageConfig(estimator="rloo"), "reward"),
}


def _minibatch(seed=0):
  rng = np.random.default_rng(seed)
  rows = tiny.random_rows(rng)
  rewards = rng.integers(0, 2, ROWS).astype(np.float32)
  group_ids = np.repeat([11, 5], G)  # two groups of G; K=4 splits each across micro-batches
  adv = advantages.compute_advantages(rewards.reshape(-1, G), "grpo").reshape(-1)
  return make_batch(
    rows, adv, prompt_len=P_LEN, max_new_tokens=N_NEW, pad_id=0, rewards=rewards,
    group_ids=group_ids,
  )  # fmt: skip


def _run(mesh, batch, micro_batches, advantage, kl_penalty, *, ref_scale=0.9):
  def critic_predicts(params):  # a critic that predicts something: GAE bootstraps real values
    bias = params["value_head"]["bias"]
    bias[...] = bias[...] + 0.3

  loss_config = losses.LossConfig(kl_coef=0.05, kl_penalty=kl_penalty, entropy_coef=0.01)
  hp = StepHParams(loss=loss_config, advantage=advantage, max_new_tokens=N_NEW)
  before, after, metrics = tiny.train_step(
    mesh, batch, hp, micro_batches=micro_batches, ref_scale=ref_scale,
    config=dataclasses.replace(TINY, value_head=advantage.critic),
    edit_params=critic_predicts if advantage.critic else None,
  )  # fmt: skip
  return tiny.gradient(before, after), metrics


@pytest.mark.parametrize("mode", ["gae", "grpo_kl_reward"])
def test_step_advantages_do_not_depend_on_the_split(mode):
  """The pre-scan advantages (no model: given values and KL) are the same for K = 1, 2, 4."""
  advantage, _ = MODES[mode]
  batch = _minibatch()
  rng = np.random.default_rng(1)
  t = batch["loss_mask"].shape[1]
  values, kl = rng.normal(size=(ROWS, t)), rng.gamma(1.0, 0.1, size=(ROWS, t))
  out = {}
  for k in (1, 2, 4):
    split = split_micro_batches({**batch, "values": values, "kl": kl}, k)
    new, metrics = _compute(
      {f: jnp.asarray(split[f]) for f in ("loss_mask", "rewards", "group_id")},
      config=advantage,
      old_values=jnp.asarray(split["values"], jnp.float32) if advantage.critic else None,
      kl=jnp.asarray(split["kl"], jnp.float32),
      kl_coef=0.05,
    )
    out[k] = ({f: np.asarray(v).reshape(ROWS, -1) for f, v in new.items()}, metrics)
  for k in (2, 4):
    for f in out[1][0]:
      np.testing.assert_allclose(out[k][0][f], out[1][0][f], rtol=1e-6, atol=1e-6, err_msg=f)
    for key, value in out[1][1].items():
      np.testing.assert_allclose(out[k][1][key], value, rtol=1e-6, atol=1e-7, err_msg=key)
  assert np.abs(out[1][0]["advantages"]).max() > 0


# Each mode compiles the step twice (about 40 s on a loaded 2-core machine).
@pytest.mark.parametrize("mode", sorted(MODES))
def test_micro_batch_split_is_exact(mode):
  mesh = tiny.one_device_mesh()
  batch = _minibatch()
  g1, m1 = _run(mesh, batch, 1, *MODES[mode])
  for k in (4,):
    gk, mk = _run(mesh, batch, k, *MODES[mode])
    np.testing.assert_allclose(mk["loss"], m1["loss"], rtol=1e-5, atol=1e-7)
    tiny.assert_trees_close(gk, g1, rtol=1e-4, atol=1e-6)
    for key in ("pg_loss", "kl", "value_loss", "explained_variance", "kl_reward_penalty"):
      if key in m1:
        np.testing.assert_allclose(mk[key], m1[key], rtol=1e-5, atol=1e-6)
  assert m1["grad_norm"] > 0 and m1["kl"] > 0
  advantage, kl_penalty = MODES[mode]
  if advantage.critic:
    assert m1["value_loss"] > 0 and np.abs(g1["value_head"]["kernel"]).sum() > 0
    assert m1["value_clip_frac"] == 0  # V_old comes from the params the update starts from
  if kl_penalty == "reward":
    assert m1["kl_reward_penalty"] > 0


def test_kl_reward_with_the_reference_equal_to_the_policy_gives_the_host_advantages():
  """KL = 0: the in-step group advantages (segment ops, over both groups) are the host's."""
  mesh = tiny.one_device_mesh()
  batch = _minibatch()
  adv = AdvantageConfig(estimator="grpo")
  g_reward, m_reward = _run(mesh, batch, 4, adv, "reward", ref_scale=1.0)
  g_loss, m_loss = _run(mesh, batch, 4, adv, "loss", ref_scale=1.0)
  assert m_reward["kl_reward_penalty"] == pytest.approx(0.0, abs=1e-6)
  np.testing.assert_allclose(m_reward["loss"], m_loss["loss"], rtol=1e-5, atol=1e-7)
  tiny.assert_trees_close(g_reward, g_loss, rtol=1e-4, atol=1e-6)
