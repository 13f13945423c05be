"""Tests for knitjax.train.advantages."""

import hypothesis
import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from knitjax.train import advantages

REWARDS = np.array([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 6.0]])


def test_grpo_hand_values():
  adv = advantages.compute_advantages(REWARDS, "grpo", eps=0.0 + 1e-6)
  # Row 0: mean 0.5, std 0.5. Row 2: mean 3, std sqrt((4 + 1 + 0 + 9) / 4) = sqrt(3.5).
  s = np.sqrt(3.5)
  want = np.array(
    [
      [0.5 / 0.500001, -0.5 / 0.500001, -0.5 / 0.500001, 0.5 / 0.500001],
      [0.0, 0.0, 0.0, 0.0],
      [-2 / (s + 1e-6), -1 / (s + 1e-6), 0.0, 3 / (s + 1e-6)],
    ]
  )
  np.testing.assert_allclose(adv, want, rtol=1e-6, atol=1e-7)
  assert adv.dtype == np.float32 and isinstance(adv, np.ndarray)


def test_drgrpo_hand_values():
  adv = advantages.compute_advantages(REWARDS, "drgrpo")
  want = [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0], [-2, -1, 0, 3]]
  np.testing.assert_allclose(adv, want, atol=1e-7)


def test_rloo_hand_values():
  adv = advantages.compute_advantages(REWARDS, "rloo")
  # Row 2, response 0: 1 - (2 + 3 + 6) / 3 = -8/3; response 3: 6 - (1 + 2 + 3) / 3 = 4.
  want = [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0, 0, 0, 0], [-8 / 3, -4 / 3, 0, 4]]
  np.testing.assert_allclose(adv, want, rtol=1e-6, atol=1e-7)


def test_jax_in_jax_out():
  adv = advantages.compute_advantages(jnp.asarray(REWARDS), "grpo")
  assert not isinstance(adv, np.ndarray) and adv.dtype == jnp.float32
  np.testing.assert_allclose(adv, advantages.compute_advantages(REWARDS, "grpo"), rtol=1e-6)


def test_equal_rewards_give_exact_zeros():
  # 0.1 is not exact in binary: a float32 mean of equal 0.1s need not equal 0.1.
  rewards = np.full((2, 7), 0.1, np.float32)
  for name in advantages.ESTIMATORS:
    assert np.all(advantages.compute_advantages(rewards, name) == 0.0)
    assert np.all(np.asarray(advantages.compute_advantages(jnp.asarray(rewards), name)) == 0.0)


def test_errors():
  with pytest.raises(ValueError, match="choose one of: grpo, drgrpo, rloo"):
    advantages.compute_advantages(REWARDS, "ppo")
  with pytest.raises(ValueError, match=r"\[num_groups, G\]"):
    advantages.compute_advantages(np.ones(4), "grpo")
  with pytest.raises(ValueError, match="G=1"):
    advantages.compute_advantages(np.ones((3, 1)), "rloo")


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
  hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=2, max_dims=2, min_side=2, max_side=6),
    elements=st.floats(-10, 10, width=32),
  )
)
def test_group_invariants(rewards):
  dr = advantages.compute_advantages(rewards, "drgrpo")
  rl = advantages.compute_advantages(rewards, "rloo")
  gr = advantages.compute_advantages(rewards, "grpo")
  g = rewards.shape[1]
  # Every estimator is centred within each group; rloo is drgrpo rescaled by G / (G - 1).
  for adv in (dr, rl, gr):
    np.testing.assert_allclose(adv.sum(axis=1), 0.0, atol=1e-3)
  np.testing.assert_allclose(rl, dr * g / (g - 1), rtol=1e-4, atol=1e-4)
  # grpo keeps the sign of drgrpo and has unit std per group (zero for equal rewards).
  big = np.abs(dr) > 1e-3
  assert np.all(np.sign(gr[big]) == np.sign(dr[big]))
  equal = rewards.max(axis=1) == rewards.min(axis=1)
  assert np.all(gr[equal] == 0) and np.all(dr[equal] == 0) and np.all(rl[equal] == 0)
  spread = rewards.std(axis=1) > 1e-2
  np.testing.assert_allclose(gr[spread].std(axis=1), 1.0, atol=1e-3)


def test_reward_metrics():
  m = advantages.reward_metrics(REWARDS)
  assert m["reward_mean"] == pytest.approx(REWARDS.mean())
  assert m["reward_std"] == pytest.approx(REWARDS.std())
  assert m["frac_groups_with_signal"] == pytest.approx(2 / 3)
