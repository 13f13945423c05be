"""GAE, whitening, the clipped value loss and the in-step group estimators, by hand."""

import jax.numpy as jnp
import numpy as np
import pytest

from knitjax.train import advantages, gae, losses, value_loss
from knitjax.train.step_advantages import AdvantageConfig


def _gae_by_hand(r, v, m, gamma, lam):
  """The GAE recursion written out over each row's response positions (skipping holes)."""
  adv = np.zeros_like(r)
  for i in range(len(r)):
    pos = [t for t in range(r.shape[1]) if m[i, t]]
    next_v = next_a = 0.0
    for t in reversed(pos):
      delta = r[i, t] + gamma * next_v - v[i, t]
      next_a = delta + gamma * lam * next_a
      next_v = v[i, t]
      adv[i, t] = next_a
  return adv


def test_gae_matches_the_recursion_by_hand():
  # Row 0: three response tokens; row 1: one (a short row); row 2: a hole (tool output) at t=2.
  m = np.array([[0, 1, 1, 1, 0], [0, 1, 0, 0, 0], [0, 1, 0, 1, 1]], np.float32)
  v = np.array([[9, 0.5, 0.2, -0.1, 9], [9, 0.3, 9, 9, 9], [9, 0.1, 5.0, 0.4, 0.2]], np.float32)
  r = np.array([[0, 0, 0, 1.0, 0], [0, -1.0, 0, 0, 0], [0, 0.1, 0, 0, 2.0]], np.float32)
  gamma, lam = 0.9, 0.8
  adv, ret = gae.gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), gamma=gamma, lam=lam)
  # Row 0 by hand: delta_3 = 1 - (-0.1) = 1.1; delta_2 = 0.9 * -0.1 - 0.2 = -0.29;
  # delta_1 = 0.9 * 0.2 - 0.5 = -0.32; A_3 = 1.1, A_2 = -0.29 + 0.72 * 1.1 = 0.502,
  # A_1 = -0.32 + 0.72 * 0.502 = 0.04144.
  np.testing.assert_allclose(adv[0], [0, 0.04144, 0.502, 1.1, 0], atol=1e-6)
  np.testing.assert_allclose(adv[1], [0, -1.3, 0, 0, 0], atol=1e-6)  # -1 - 0.3, nothing after
  np.testing.assert_allclose(adv, _gae_by_hand(r, v, m, gamma, lam), atol=1e-6)
  # The hole at t=2 of row 2 is skipped: t=1 bootstraps from t=3's value, not t=2's 5.0.
  np.testing.assert_allclose(adv[2, 1], 0.1 + 0.9 * 0.4 - 0.1 + 0.72 * adv[2, 3], atol=1e-6)
  np.testing.assert_allclose(ret, (adv + v) * m, atol=1e-6)


def test_gae_with_gamma_lambda_one_is_reward_to_go_minus_value():
  m = np.array([[1, 1, 1, 0]], np.float32)
  v = np.array([[0.2, 0.4, 0.6, 0.0]], np.float32)
  r = gae.token_rewards(jnp.array([1.0]), jnp.asarray(m))
  adv, ret = gae.gae(r, jnp.asarray(v), jnp.asarray(m), gamma=1.0, lam=1.0)
  np.testing.assert_allclose(ret, [[1, 1, 1, 0]], atol=1e-6)
  np.testing.assert_allclose(adv, [[0.8, 0.6, 0.4, 0]], atol=1e-6)


def test_token_rewards_put_the_reward_on_the_last_response_token_and_kl_on_every_one():
  m = jnp.array([[0, 1, 1, 0], [0, 1, 0, 1], [0, 0, 0, 0]], jnp.float32)
  kl = jnp.full((3, 4), 0.5)
  got = gae.token_rewards(jnp.array([2.0, 3.0, 4.0]), m, kl=kl, kl_coef=0.1)
  np.testing.assert_allclose(
    got, [[0, -0.05, 1.95, 0], [0, -0.05, 0, 2.95], [0, 0, 0, 0]], atol=1e-6
  )


def test_gae_restarts_at_each_segment_of_a_packed_row():
  """Three rows packed into one sequence (the last one ending at the sequence's end) give each
  row's own recursion: nothing bootstraps across a segment boundary."""
  m = np.array([[0, 1, 1, 1, 0], [0, 1, 0, 1, 0], [1, 1, 0, 0, 0]], np.float32)
  v = np.array([[9, 0.5, 0.2, -0.1, 9], [9, 0.1, 5.0, 0.4, 0.2], [0.3, -0.2, 7, 7, 7]], np.float32)
  reward = np.array([1.0, 2.0, -1.0], np.float32)
  kl = np.random.default_rng(0).gamma(1.0, 0.1, m.shape).astype(np.float32)
  lengths = [5, 5, 2]  # the third row ends at the packed sequence's last column
  seg = np.repeat([1, 2, 3], lengths)[None].astype(np.int32)
  cat = lambda x: np.concatenate([row[:n] for row, n in zip(x, lengths, strict=True)])[None]  # noqa: E731
  gamma, lam = 0.9, 0.8
  r_pad = gae.token_rewards(jnp.asarray(reward), jnp.asarray(m), kl=jnp.asarray(kl), kl_coef=0.1)
  r_pack = gae.token_rewards(
    jnp.asarray(np.repeat(reward, lengths)[None]), jnp.asarray(cat(m)), kl=jnp.asarray(cat(kl)),
    kl_coef=0.1, segment_ids=jnp.asarray(seg),
  )  # fmt: skip
  np.testing.assert_array_equal(r_pack, cat(np.asarray(r_pad)))
  want = _gae_by_hand(np.asarray(r_pad), v, m, gamma, lam)
  adv, ret = gae.gae(
    r_pack, jnp.asarray(cat(v)), jnp.asarray(cat(m)), gamma=gamma, lam=lam,
    segment_ids=jnp.asarray(seg),
  )  # fmt: skip
  np.testing.assert_allclose(adv, cat(want), atol=1e-6)
  np.testing.assert_allclose(ret, cat((want + v) * m), atol=1e-6)
  # Without the segments the first row would bootstrap from the second's values.
  leak, _ = gae.gae(r_pack, jnp.asarray(cat(v)), jnp.asarray(cat(m)), gamma=gamma, lam=lam)
  assert not np.allclose(leak, cat(want), atol=1e-3)


def test_last_response_tokens_per_segment():
  m = jnp.array([[0, 1, 1, 0, 1, 1, 0, 0], [1, 0, 1, 1, 0, 0, 0, 0]], jnp.float32)
  seg = jnp.array([[1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 2, 2, 3, 3, 0]], jnp.int32)
  got = gae.last_response_tokens(m, seg)
  # Row 1, segment 2: its response token is its first; segment 3 has none.
  np.testing.assert_array_equal(got, [[0, 0, 1, 0, 0, 1, 0, 0], [0, 0, 1, 1, 0, 0, 0, 0]])
  np.testing.assert_array_equal(
    gae.last_response_tokens(m), [[0] * 5 + [1, 0, 0], [0] * 3 + [1] + [0] * 4]
  )


def test_whiten_uses_only_masked_positions():
  x = jnp.array([[100.0, 1.0, 2.0], [3.0, 4.0, -50.0]])
  m = jnp.array([[0, 1, 1], [1, 1, 0]], jnp.float32)
  got = np.asarray(gae.whiten(x, m))
  kept = np.array([1.0, 2.0, 3.0, 4.0])
  want = (kept - kept.mean()) / np.sqrt(kept.var() + 1e-8)
  np.testing.assert_allclose(got[np.asarray(m) > 0], want, rtol=1e-6)
  assert got[0, 0] == 0 and got[1, 2] == 0


def test_clipped_value_loss_by_hand():
  v = jnp.array([1.0, 0.6, 1.5, 0.0])
  old = jnp.array([0.5, 0.5, 0.5, 0.5])
  ret = jnp.array([2.0, 0.0, 1.0, 1.0])
  loss, clipped = value_loss.value_loss(v, old, ret, clip=0.2)
  # 1: (1-2)^2 = 1 < (0.7-2)^2 = 1.69, the clip binds; 2: inside the clip, 0.36;
  # 3: 0.25 > (0.7-1)^2 = 0.09; 4: 1 > (0.3-1)^2 = 0.49. Each halved.
  np.testing.assert_allclose(loss, [0.845, 0.18, 0.125, 0.5], atol=1e-6)
  np.testing.assert_array_equal(clipped, [True, False, False, False])
  plain, never = value_loss.value_loss(v, old, ret, clip=None)
  np.testing.assert_allclose(plain, [0.5, 0.18, 0.125, 0.5], atol=1e-6)
  assert not np.asarray(never).any()


def test_explained_variance():
  ret = jnp.array([[1.0, 2.0, 3.0, 99.0]])
  m = jnp.array([[1, 1, 1, 0]], jnp.float32)
  assert float(value_loss.explained_variance(ret, ret, m)) == pytest.approx(1.0)
  assert float(value_loss.explained_variance(jnp.full((1, 4), 5.0), ret, m)) == pytest.approx(0.0)
  half = jnp.array([[1.5, 2.0, 2.5, 0.0]])  # residual variance 1/4 of the returns'
  assert float(value_loss.explained_variance(half, ret, m)) == pytest.approx(0.75)


@pytest.mark.parametrize("estimator", sorted(advantages.ESTIMATORS))
def test_segment_advantages_equal_compute_advantages(estimator):
  rng = np.random.default_rng(0)
  rewards = rng.normal(size=(5, 4)).astype(np.float32)
  rewards[2] = 0.7  # no signal: exactly 0 under every estimator
  rewards[3, :2] = 1.0
  want = np.asarray(advantages.compute_advantages(jnp.asarray(rewards), estimator))
  ids = np.repeat(np.array([40, 7, 13, 2, 99]), 4)
  order = rng.permutation(20)  # rows in any order, ids any ints
  got = advantages.segment_advantages(
    jnp.asarray(rewards.reshape(-1)[order]), jnp.asarray(ids[order]), estimator
  )
  np.testing.assert_allclose(np.asarray(got), want.reshape(-1)[order], rtol=1e-6, atol=1e-6)
  assert (np.asarray(got)[np.isin(order, np.arange(8, 12))] == 0).all()


def test_policy_loss_takes_per_token_advantages():
  rng = np.random.default_rng(1)
  logp = jnp.asarray(rng.normal(-2, 0.3, (3, 5)), jnp.float32)
  beh = jnp.asarray(rng.normal(-2, 0.3, (3, 5)), jnp.float32)
  m = jnp.asarray(rng.random((3, 5)) > 0.3, jnp.float32)
  adv_b = jnp.array([0.5, -1.0, 2.0])
  norm = losses.Normalizer.from_mask(m, max_len=5.0)
  cfg = losses.LossConfig()
  per_seq, _ = losses.policy_loss(logp, beh, adv_b, m, config=cfg, norm=norm)
  per_tok, _ = losses.policy_loss(
    logp, beh, jnp.broadcast_to(adv_b[:, None], (3, 5)), m, config=cfg, norm=norm
  )
  np.testing.assert_allclose(per_tok, per_seq, rtol=1e-6)


def test_advantage_config_errors_name_the_field():
  with pytest.raises(ValueError, match="unknown advantage 'ppo'"):
    AdvantageConfig(estimator="ppo")
  with pytest.raises(ValueError, match="gae_lambda must be in"):
    AdvantageConfig(estimator="gae", gae_lambda=1.5)
  with pytest.raises(ValueError, match="value_coef must be > 0"):
    AdvantageConfig(estimator="gae", value_coef=0.0)
  with pytest.raises(ValueError, match="value_clip must be None or > 0"):
    AdvantageConfig(estimator="gae", value_clip=0.0)
  with pytest.raises(ValueError, match="unknown kl penalty"):
    losses.LossConfig(kl_penalty="advantage")
