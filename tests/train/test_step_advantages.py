"""In-step advantages on packed rows against the same rows padded: GAE (restarting at every
segment), the KL as a reward (in GAE's token rewards and in the group estimators), the losses
built on them and their gradients, and the real train step.

Tolerances are float32 summation order: packed and padded layouts add the same terms in a
different order (segment sums instead of row sums), rtol 1e-5 / atol 1e-6 on advantages,
returns, metrics, losses and per-token gradients; the real step (its model forward differs in
its attention layout too) rtol 1e-4 / atol 1e-6 on every parameter's update.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from knitjax import sharding
from knitjax.train import losses, step_advantages, value_loss
from knitjax.train.batch import make_batch, pad_rows, split_micro_batches
from knitjax.train.step import (
  StepHParams,
)
from knitjax.train.step_advantages import AdvantageConfig
from tests.tiny import N_NEW, P_LEN, TINY
from tests.train.test_packing import _source_index, sgd_step

ROWS, G, K = 12, 4, 2
PACK_LEN = P_LEN + N_NEW + 3
KL_COEF = 0.05

MODES = {
  # gamma, lambda < 1, whitened, the KL a loss term: GAE alone.
  "gae": (AdvantageConfig(estimator="gae", gamma=0.95, gae_lambda=0.9), "loss"),
  # GAE with the KL in the token rewards, unwhitened and unclipped.
  "gae_kl_reward": (AdvantageConfig(estimator="gae", whiten=False, value_clip=None), "reward"),
  "grpo_kl_reward": (AdvantageConfig(estimator="grpo"), "reward"),
  "rloo_kl_reward": (AdvantageConfig(estimator="rloo"), "reward"),
  "drgrpo_kl_reward": (AdvantageConfig(estimator="drgrpo"), "reward"),
}


def _minibatch(seed=0):
  """Three groups of G rows, prompts of 1..P and responses of 1..N tokens, group ids 0, 7, 3
  (0 included: an id the packed path must not confuse with its empty slots)."""
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(3, 32, rng.integers(1, P_LEN + 1)).astype(np.int32) for _ in range(ROWS)]
  lens = rng.integers(1, N_NEW + 1, ROWS)
  responses = [rng.integers(3, 32, n).astype(np.int32) for n in lens]
  logps = [rng.normal(-3.0, 0.5, n).astype(np.float32) for n in lens]
  rewards = rng.normal(size=ROWS).astype(np.float32)
  rewards[G : 2 * G] = 0.5  # equal rewards: the KL penalty alone separates this group's rows
  return make_batch(
    pad_rows(prompts, responses, logps), np.zeros(ROWS, np.float32), prompt_len=P_LEN,
    max_new_tokens=N_NEW, pad_id=0, rewards=rewards, group_ids=np.repeat([0, 7, 3], G),
  )  # fmt: skip


def _packed(batch):
  packed, src = _source_index(batch, pack_len=PACK_LEN, multiple=2 * K)
  seg = packed["segment_ids"]
  # The cases the restart must get right: a row ending at its sequence's last column, and
  # sequences holding different numbers of rows (and all-padding ones: the multiple).
  assert (seg[:, -1] > 0).any() and len(set(seg.max(axis=1).tolist())) >= 3
  assert packed["valid"].size < batch["valid"].size
  return packed, src


def _advantages(batch, mode, values, kl):
  """``step_advantages.compute`` on a ``[K, rows / K, T]`` split; the results back as rows."""
  advantage, _ = MODES[mode]
  fields = ("loss_mask", "rewards", "group_id", "segment_ids")
  split = split_micro_batches({**batch, "values": values, "kl": kl}, K)
  new, metrics = step_advantages.compute(
    {f: jnp.asarray(split[f]) for f in fields if f in split},
    config=advantage,
    old_values=jnp.asarray(split["values"]) if advantage.critic else None,
    kl=jnp.asarray(split["kl"]) if MODES[mode][1] == "reward" else None,
    kl_coef=KL_COEF,
  )
  n = len(batch["loss_mask"])
  return {f: v.reshape(n, *v.shape[2:]) for f, v in new.items()}, metrics


def _loss(logp, values, batch, new, advantage):
  """The step's micro-batch loss on the whole batch: policy loss plus the critic's value loss."""
  seg = batch.get("segment_ids")
  norm = losses.Normalizer.from_mask(batch["loss_mask"], max_len=N_NEW, segment_ids_bt=seg)
  config = losses.LossConfig(aggregation="seq_mean_token_mean", entropy_coef=0.0)
  loss, sums = losses.policy_loss(
    logp, batch["behavior_logp"], new["advantages"], batch["loss_mask"], config=config, norm=norm,
    segment_ids_bt=seg,
  )  # fmt: skip
  if advantage.critic:
    v_loss, _ = value_loss.value_loss(
      values, new["old_values"], new["returns"], clip=advantage.value_clip
    )
    loss = loss + advantage.value_coef * losses.aggregate(
      v_loss, batch["loss_mask"], aggregation=config.aggregation, norm=norm, segment_ids_bt=seg
    )
  return loss, sums


@pytest.mark.parametrize("mode", sorted(MODES))
def test_packed_advantages_losses_and_gradients_equal_padded(mode):
  advantage, _ = MODES[mode]
  batch = _minibatch(seed=3)
  packed, src = _packed(batch)
  rng = np.random.default_rng(1)
  shape = batch["valid"].shape
  values = rng.normal(0.3, 0.5, shape).astype(np.float32)
  kl = rng.gamma(1.0, 0.2, shape).astype(np.float32)
  logp = (batch["behavior_logp"] + rng.normal(0, 0.3, shape)).astype(np.float32)
  v = packed["valid"]
  take = lambda x: np.where(v, np.asarray(x).reshape(-1)[src], 0).astype(np.float32)  # noqa: E731

  new0, m0 = _advantages(batch, mode, values, kl)
  new1, m1 = _advantages(packed, mode, take(values), take(kl))
  assert set(m1) == set(m0) and set(new1) == set(new0)
  for key in m0:
    np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5, atol=1e-6, err_msg=key)
  mask = packed["loss_mask"] > 0
  for f in new0:
    per_token = new0[f] if new0[f].ndim == 2 else np.broadcast_to(new0[f][:, None], shape)
    np.testing.assert_allclose(
      np.asarray(new1[f])[mask], take(per_token)[mask], rtol=1e-5, atol=1e-6, err_msg=f
    )
    assert (np.asarray(new1[f])[~v] == 0).all()  # nothing on padding
  adv = np.asarray(new1["advantages"])[mask]
  assert np.abs(adv).max() > 0.1 and len(np.unique(np.round(adv, 5))) > 3

  grad = jax.value_and_grad(_loss, argnums=(0, 1), has_aux=True)
  (l0, s0), (g0_logp, g0_v) = grad(jnp.asarray(logp), jnp.asarray(values), batch, new0, advantage)
  (l1, s1), (g1_logp, g1_v) = grad(
    jnp.asarray(take(logp)), jnp.asarray(take(values)), packed, new1, advantage
  )
  np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-7)
  for key in s0:
    np.testing.assert_allclose(s1[key], s0[key], rtol=1e-5, atol=1e-6, err_msg=key)
  for g0, g1 in ((g0_logp, g1_logp), (g0_v, g1_v)):
    np.testing.assert_allclose(np.asarray(g1)[v], take(g0)[v], rtol=1e-5, atol=1e-7)
    assert float(np.abs(np.asarray(g1)).sum()) == pytest.approx(
      float(np.abs(np.asarray(g0)).sum()), rel=1e-5
    )
  assert np.abs(np.asarray(g1_logp)).sum() > 0
  assert (np.abs(np.asarray(g1_v)).sum() > 0) == advantage.critic


def _run(mesh, batch, mode, *, packed):
  advantage, kl_penalty = MODES[mode]

  def adjust(params):  # a critic that predicts something, so GAE bootstraps from real values
    if advantage.critic:
      bias = params["value_head"]["bias"]
      bias[...] = bias[...] + 0.3

  loss_config = losses.LossConfig(kl_coef=KL_COEF, kl_penalty=kl_penalty, entropy_coef=0.01)
  hp = StepHParams(loss=loss_config, advantage=advantage, max_new_tokens=N_NEW)
  config = dataclasses.replace(TINY, value_head=advantage.critic)
  return sgd_step(mesh, batch, hp, packed=packed, micro_batches=K, config=config, adjust=adjust)


# Each mode compiles two steps (~10-20 s on two busy cores).
STEP_MODES = ["gae", "gae_kl_reward", "grpo_kl_reward"]


@pytest.mark.parametrize("mode", STEP_MODES)
def test_packed_step_equals_padded_step(mode):
  """The real step, rows on 2 batch shards and K = 2: loss, metrics and the SGD update."""
  mesh = sharding.make_mesh((2, 1, 1), devices=jax.devices()[:2])
  batch = _minibatch(seed=3)
  packed, _ = _packed(batch)
  g0, m0 = _run(mesh, batch, mode, packed=False)
  g1, m1 = _run(mesh, packed, mode, packed=True)
  assert m0["grad_norm"] > 0 and m0["kl"] != 0
  assert m1["num_seqs"] == m0["num_seqs"] == ROWS and m1["num_tokens"] == m0["num_tokens"]
  assert set(m1) == set(m0)
  for key in sorted(m0):
    np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5, atol=1e-6, err_msg=key)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
  advantage, kl_penalty = MODES[mode]
  if advantage.critic:
    assert m1["value_loss"] > 0 and np.abs(g1["value_head"]["kernel"]).sum() > 0
  if kl_penalty == "reward":
    assert m1["kl_reward_penalty"] > 0
