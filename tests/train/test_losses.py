"""Tests for knitjax.train.losses: hand-computed values and exact micro-batch accumulation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from knitjax.train import losses
from knitjax.train.losses import LossConfig, Normalizer
from tests import tiny

# Two sequences of 3 tokens. Ratios r = exp(logp - behavior) are chosen by hand:
#   seq 0, A = +1: r = 1.5 (clipped at 1.2), 0.5, 1.1          -> pg = -1.2, -0.5, -1.1
#   seq 1, A = -2: r = 1.5, 0.5 (clipped at 0.8), 3.0 (masked) -> pg = 3.0, 1.6, (masked)
RATIOS = np.array([[1.5, 0.5, 1.1], [1.5, 0.5, 3.0]], np.float32)
BEHAVIOR = np.array([[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.5]], np.float32)
LOGP = BEHAVIOR + np.log(RATIOS)
ADV = np.array([1.0, -2.0], np.float32)
MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
NORM = Normalizer(num_tokens=5.0, num_seqs=2.0, max_len=4.0)
PG_SUM = -1.2 - 0.5 - 1.1 + 3.0 + 1.6  # 1.8


def _loss(config, logp=LOGP, mask=MASK, norm=NORM, **kw):
  return losses.policy_loss(
    jnp.asarray(logp), jnp.asarray(BEHAVIOR), jnp.asarray(ADV), jnp.asarray(mask),
    config=config, norm=norm, **kw,
  )  # fmt: skip


@pytest.mark.parametrize(
  "aggregation, want",
  [
    ("token_mean", PG_SUM / 5),
    ("seq_mean_token_mean", ((-1.2 - 0.5 - 1.1) / 3 + (3.0 + 1.6) / 2) / 2),
    ("seq_mean_token_sum", PG_SUM / (2 * 4)),
  ],
)
def test_ppo_clip_hand_values(aggregation, want):
  loss, sums = _loss(LossConfig(aggregation=aggregation))
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  m = losses.finalize_metrics(sums)
  assert m["clip_frac"] == pytest.approx(2 / 5)
  assert m["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 1.5 + 0.5) / 5, rel=1e-5)
  k3 = [r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 1.5, 0.5)]
  assert m["approx_kl"] == pytest.approx(sum(k3) / 5, rel=1e-5)
  assert m["pg_loss"] == pytest.approx(PG_SUM / 5, rel=1e-5)
  assert m["num_tokens"] == 5 and m["num_seqs"] == 2
  assert m["tis_frac"] == 0 and m["entropy"] == 0 and m["kl"] == 0


def test_ppo_clip_hand_gradient():
  # d pg / d logp = -A * r on unclipped tokens, 0 on clipped and masked ones.
  grad = jax.grad(lambda lp: _loss(LossConfig(), logp=lp)[0])(jnp.asarray(LOGP))
  want = np.array([[0.0, -0.5, -1.1], [3.0, 0.0, 0.0]]) / 5
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def test_clip_higher():
  # eps_high 0.6 lets seq 0's r = 1.5 through: pg = -1.5 instead of -1.2.
  loss, sums = _loss(LossConfig(eps_low=0.2, eps_high=0.6))
  np.testing.assert_allclose(loss, (PG_SUM + 1.2 - 1.5) / 5, rtol=1e-5)
  assert losses.finalize_metrics(sums)["clip_frac"] == pytest.approx(1 / 5)


def test_tis_cap_bounds_negative_advantage_tokens():
  mask = np.ones_like(MASK)  # unmask seq 1's r = 3.0 token (A = -2)
  norm = Normalizer(6.0, 2.0, 4.0)
  f = lambda cfg: lambda lp: _loss(cfg, logp=lp, mask=mask, norm=norm)
  plain, plain_sums = f(LossConfig())(jnp.asarray(LOGP))
  capped, capped_sums = f(LossConfig(tis_cap=2.0))(jnp.asarray(LOGP))
  # Plain PPO: pg = -min(3 * -2, 1.2 * -2) = 6, gradient -A * r = 6. Capped: 4, gradient 4.
  np.testing.assert_allclose(plain, (PG_SUM + 6.0) / 6, rtol=1e-5)
  np.testing.assert_allclose(capped, (PG_SUM + 4.0) / 6, rtol=1e-5)
  g_plain = jax.grad(lambda lp: f(LossConfig())(lp)[0])(jnp.asarray(LOGP))
  g_capped = jax.grad(lambda lp: f(LossConfig(tis_cap=2.0))(lp)[0])(jnp.asarray(LOGP))
  np.testing.assert_allclose(g_plain[1, 2], 6.0 / 6, rtol=1e-5)
  np.testing.assert_allclose(g_capped[1, 2], 4.0 / 6, rtol=1e-5)
  # Every other token is untouched (the cap 2 >= 1 + eps_high never binds for A > 0).
  keep = np.ones_like(mask, bool)
  keep[1, 2] = False
  np.testing.assert_allclose(g_capped[keep], g_plain[keep], rtol=1e-6)
  assert losses.finalize_metrics(capped_sums)["tis_frac"] == pytest.approx(1 / 6)
  assert losses.finalize_metrics(plain_sums)["tis_frac"] == 0


def test_tis_cap_positive_advantage_above_cap_stays_clipped():
  logp = BEHAVIOR.copy()
  logp[0, 0] += math.log(5.0)  # A = +1, r = 5 > cap
  grad = jax.grad(lambda lp: _loss(LossConfig(tis_cap=2.0), logp=lp)[0])(jnp.asarray(logp))
  assert grad[0, 0] == 0.0


def test_kl_and_entropy_hand_values():
  # ref - logp = log 2 on every token: k3 = 2 - log 2 - 1; d k3 / d logp = 1 - 2 = -1.
  ref = LOGP + np.log(2.0)
  ent = np.array([[0.5, 1.0, 1.5], [2.0, 2.5, 9.0]], np.float32)
  cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01)
  k3 = 1.0 - math.log(2.0)

  def f(lp):
    return _loss(cfg, logp=lp, ref_logp_bt=jnp.asarray(ref), entropy_bt=jnp.asarray(ent))

  loss, sums = f(jnp.asarray(LOGP))
  np.testing.assert_allclose(loss, PG_SUM / 5 + 0.1 * k3 - 0.01 * 7.5 / 5, rtol=1e-5)
  m = losses.finalize_metrics(sums)
  assert m["kl"] == pytest.approx(k3, rel=1e-5)
  assert m["entropy"] == pytest.approx(7.5 / 5)
  grad = jax.grad(lambda lp: f(lp)[0])(jnp.asarray(LOGP))
  want = (np.array([[0.0, -0.5, -1.1], [3.0, 0.0, 0.0]]) + 0.1 * -1.0 * MASK) / 5
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def test_token_logprobs_and_entropy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
  targets = rng.integers(0, 5, size=(2, 3))
  logp = losses.token_logprobs(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(targets))
  assert logp.dtype == jnp.float32
  ls = jnp.asarray(logits, jnp.bfloat16).astype(np.float32)
  ls = np.asarray(ls) - np.log(np.exp(np.asarray(ls)).sum(-1, keepdims=True))
  np.testing.assert_allclose(logp, np.take_along_axis(ls, targets[..., None], -1)[..., 0], 1e-5)
  hot = losses.token_logprobs(jnp.asarray(logits), jnp.asarray(targets), temperature=0.5)
  ls2 = logits / 0.5 - np.log(np.exp(logits / 0.5).sum(-1, keepdims=True))
  np.testing.assert_allclose(hot, np.take_along_axis(ls2, targets[..., None], -1)[..., 0], 1e-5)
  ent = losses.token_entropy(jnp.asarray(logits))
  p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  np.testing.assert_allclose(ent, -(p * np.log(p)).sum(-1), rtol=1e-5)
  np.testing.assert_allclose(losses.token_entropy(jnp.zeros((1, 1, 8))), [[math.log(8)]], 1e-6)


@pytest.mark.parametrize("aggregation", losses.AGGREGATIONS)
def test_micro_batches_sum_to_mini_batch_loss_and_gradient(aggregation):
  data = tiny.loss_inputs(seed=1)
  cfg = LossConfig(
    aggregation=aggregation, eps_high=0.28, tis_cap=1.5, kl_coef=0.05, entropy_coef=0.01
  )
  norm = Normalizer.from_mask(data["mask"], max_len=6)
  assert (norm.num_tokens, norm.num_seqs) == (data["mask"].sum(), 7)

  def loss_fn(logp, ent, behavior, adv, mask, ref):
    return losses.policy_loss(
      logp, behavior, adv, mask, config=cfg, norm=norm, ref_logp_bt=ref, entropy_bt=ent
    )

  # Jitted so that each micro-batch shape compiles once instead of op by op.
  grad_fn = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))
  names = ("logp", "ent", "behavior", "adv", "mask", "ref")
  (loss, sums), (g_logp, g_ent) = grad_fn(*(data[k] for k in names))
  for bounds in ([0, 8], [0, 3, 8], [0, 1, 2, 5, 8], list(range(9))):
    total, parts_logp, parts_ent, acc = 0.0, [], [], None
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
      (part, part_sums), (gl, ge) = grad_fn(*(data[k][lo:hi] for k in names))
      total += part
      parts_logp.append(gl)
      parts_ent.append(ge)
      acc = part_sums if acc is None else jax.tree.map(jnp.add, acc, part_sums)
    np.testing.assert_allclose(total, loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.concatenate(parts_logp), g_logp, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(np.concatenate(parts_ent), g_ent, rtol=1e-5, atol=1e-8)
    got, want = losses.finalize_metrics(acc), losses.finalize_metrics(sums)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_per_micro_batch_token_mean_is_a_different_objective():
  # The test above has teeth: averaging per-micro-batch token means changes the loss.
  data = tiny.loss_inputs(seed=2)
  cfg = LossConfig()

  def loss(sl):
    mask = data["mask"][sl]
    norm = Normalizer.from_mask(mask, max_len=6)
    args = (data["logp"][sl], data["behavior"][sl], data["adv"][sl], mask)
    return losses.policy_loss(*map(jnp.asarray, args), config=cfg, norm=norm)[0]

  averaged = (loss(slice(0, 2)) + loss(slice(2, 8))) / 2
  assert abs(float(averaged) - float(loss(slice(None)))) > 1e-3


def test_jit_with_traced_normalizer():
  data = tiny.loss_inputs(seed=3)
  cfg = LossConfig(aggregation="seq_mean_token_mean")

  @jax.jit
  def f(logp, behavior, adv, mask):
    norm = Normalizer.from_mask(mask, max_len=6)
    return losses.policy_loss(logp, behavior, adv, mask, config=cfg, norm=norm)[0]

  args = [jnp.asarray(data[k]) for k in ("logp", "behavior", "adv", "mask")]
  eager = losses.policy_loss(*args, config=cfg, norm=Normalizer.from_mask(data["mask"], max_len=6))[
    0
  ]
  np.testing.assert_allclose(f(*args), eager, rtol=1e-6)
  # A Normalizer is a pytree, so it can also be an argument of a jitted function.
  g = jax.jit(lambda n: n.num_tokens / n.num_seqs)
  assert float(g(Normalizer(6.0, 2.0, 4.0))) == 3.0


def test_extreme_ratios_stay_finite():
  logp = BEHAVIOR + np.array([[200.0, -200.0, 0.0], [200.0, -200.0, 0.0]], np.float32)
  for cfg in (LossConfig(), LossConfig(tis_cap=2.0)):
    loss, grad = jax.value_and_grad(lambda lp, c=cfg: _loss(c, logp=lp)[0])(jnp.asarray(logp))
    assert np.isfinite(loss) and np.all(np.isfinite(grad))


def test_config_errors():
  with pytest.raises(ValueError, match="choose one of: token_mean, seq_mean_token_mean"):
    LossConfig(aggregation="sum")
  with pytest.raises(ValueError, match="tis_cap"):
    LossConfig(tis_cap=1.1, eps_high=0.2)
  with pytest.raises(ValueError, match="eps_low"):
    LossConfig(eps_low=1.0)
  with pytest.raises(ValueError, match="num_tokens"):
    Normalizer(0.0, 1.0, 1.0)
  with pytest.raises(ValueError, match="needs ref_logp_bt"):
    _loss(LossConfig(kl_coef=0.1))
  with pytest.raises(ValueError, match="needs entropy_bt"):
    _loss(LossConfig(entropy_coef=0.1))


def test_normalizer_from_stacked_micro_batch_mask():
  mask = np.array([[[1, 1, 0], [0, 0, 0]], [[1, 0, 0], [1, 1, 1]]], np.float32)  # [K, B/K, T]
  for m in (mask, jnp.asarray(mask)):
    norm = Normalizer.from_mask(m, max_len=3.0)
    assert (float(norm.num_tokens), float(norm.num_seqs), norm.max_len) == (6.0, 3.0, 3.0)
