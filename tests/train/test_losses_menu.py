"""Tests for the loss menu: KL estimators, dual-clip, GSPO, CISPO, aggregations, overlong penalty.

Hand-computed values on tiny arrays, and the exact micro-batch split (the mini-batch's loss and
gradients equal the sums over its micro-batches) for every mode.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from knitjax.train import kl as kl_lib
from knitjax.train import losses, ratios
from knitjax.train.losses import LossConfig, Normalizer
from knitjax.train.reward_shaping import overlong_penalty
from tests import tiny

# Two sequences of 3 tokens, A = (+1, -2), ratios r = exp(logp - behavior) chosen by hand.
RATIOS = np.array([[1.5, 0.5, 1.1], [1.5, 0.5, 3.0]], np.float32)
BEHAVIOR = np.array([[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.5]], np.float32)
LOGP = BEHAVIOR + np.log(RATIOS)
ADV = np.array([1.0, -2.0], np.float32)
FULL = np.ones((2, 3), np.float32)
NORM6 = Normalizer(num_tokens=6.0, num_seqs=2.0, max_len=4.0)


def _loss(config, logp=LOGP, mask=FULL, norm=NORM6, behavior=BEHAVIOR, **kw):
  return losses.policy_loss(
    jnp.asarray(logp), jnp.asarray(behavior), jnp.asarray(ADV), jnp.asarray(mask),
    config=config, norm=norm, **kw,
  )  # fmt: skip


def _value_and_grad(config, logp=LOGP, **kw):
  fn = lambda lp: _loss(config, logp=lp, **kw)  # noqa: E731
  (loss, sums), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(logp))
  return float(loss), losses.finalize_metrics(sums), np.asarray(grad)


# --- aggregations -----------------------------------------------------------------------------

# Mask [[1,1,1],[1,1,0]], PPO-clip eps 0.2: pg = -1.2, -0.5, -1.1 | 3.0, 1.6, (masked); sum 1.8.
MASK5 = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
NORM5 = Normalizer(num_tokens=5.0, num_seqs=2.0, max_len=4.0)


@pytest.mark.parametrize(
  "aggregation, want",
  [
    ("seq_mean_token_sum_unscaled", 1.8 / 2),  # mean over 2 rows of per-row sums
    ("dr_grpo", 1.8 / (2 * 4)),  # Dr. GRPO: / (num_seqs * max_len)
    ("seq_mean_token_sum", 1.8 / (2 * 4)),  # the old name, unchanged: Dr. GRPO
  ],
)
def test_aggregation_hand_values(aggregation, want):
  loss, _ = _loss(LossConfig(aggregation=aggregation), mask=MASK5, norm=NORM5)
  np.testing.assert_allclose(loss, want, rtol=1e-5)


# --- KL estimators ----------------------------------------------------------------------------


def test_kl_estimators_hand_values_and_gradients():
  # d = ref - logp = (log 2, log 8, -log 8); log 2 = 0.6931, log 8 = 2.0794.
  logp = jnp.zeros((1, 3))
  ref = jnp.asarray([[math.log(2), math.log(8), -math.log(8)]])
  d = np.asarray(ref)[0]
  want = {
    "k1": -d,  # -0.6931, -2.0794, 2.0794
    "k2": d**2 / 2,  # 0.2402, 2.1620, 2.1620
    "k3": np.exp(d) - d - 1,  # 2 - 0.6931 - 1 = 0.3069, 8 - 2.0794 - 1 = 4.9206, 0.1250 + 1.0794
  }
  # d/dlogp: k1 -> 1; k2 -> -d; k3 -> 1 - exp(d) = -1, -7, 0.875.
  want_grad = {"k1": np.ones(3), "k2": -d, "k3": 1 - np.exp(d)}
  np.testing.assert_allclose(
    want["k3"], [1 - math.log(2), 7 - math.log(8), 1 / 8 + math.log(8) - 1]
  )
  for est in kl_lib.KL_ESTIMATORS:
    f = lambda lp, est=est: kl_lib.kl_estimate(lp, ref, estimator=est)  # noqa: E731
    np.testing.assert_allclose(f(logp)[0], want[est], rtol=1e-5)
    grad = jax.grad(lambda lp, f=f: f(lp).sum())(logp)
    np.testing.assert_allclose(grad[0], want_grad[est], rtol=1e-5)


def test_kl_clamp_hand_values():
  # clamp 2: k1 (-0.6931, -2.0794, 2.0794) -> (-0.6931, -2, 2), k3 4.9206 -> 2; the clamped
  # tokens get no gradient.
  logp = jnp.zeros((1, 3))
  ref = jnp.asarray([[math.log(2), math.log(8), -math.log(8)]])
  k1 = lambda lp: kl_lib.kl_estimate(lp, ref, estimator="k1", clamp=2.0)  # noqa: E731
  np.testing.assert_allclose(k1(logp)[0], [-math.log(2), -2.0, 2.0], rtol=1e-5)
  np.testing.assert_allclose(jax.grad(lambda lp: k1(lp).sum())(logp)[0], [1, 0, 0])
  k3 = lambda lp: kl_lib.kl_estimate(lp, ref, estimator="k3", clamp=2.0)  # noqa: E731
  np.testing.assert_allclose(k3(logp)[0], [1 - math.log(2), 2.0, 1 / 8 + math.log(8) - 1], 1e-5)
  np.testing.assert_allclose(jax.grad(lambda lp: k3(lp).sum())(logp)[0], [-1, 0, 0.875], 1e-5)


@pytest.mark.parametrize(
  "estimator, kl, dkl",  # per token, with ref - logp = log 2 everywhere
  [
    ("k1", -math.log(2), 1.0),
    ("k2", math.log(2) ** 2 / 2, -math.log(2)),
    ("k3", 1 - math.log(2), -1.0),
  ],
)
def test_kl_estimator_as_loss_term(estimator, kl, dkl):
  ref = jnp.asarray(LOGP + np.log(2.0))
  plain, _, g_plain = _value_and_grad(LossConfig())
  cfg = LossConfig(kl_coef=0.1, kl_estimator=estimator)
  loss, m, grad = _value_and_grad(cfg, ref_logp_bt=ref)
  np.testing.assert_allclose(loss, plain + 0.1 * kl, rtol=1e-5)  # token mean of a constant
  np.testing.assert_allclose(grad, g_plain + 0.1 * dkl / 6, rtol=1e-5, atol=1e-7)
  assert m["kl"] == pytest.approx(kl, rel=1e-5)


# --- dual-clip ----------------------------------------------------------------------------------

# All six tokens, eps 0.2. PPO-clip per-token loss:
#   seq 0, A = +1: r = 1.5, 0.5, 1.1 -> -1.2 (clipped), -0.5, -1.1
#   seq 1, A = -2: r = 1.5, 0.5, 3.0 -> 3.0, 1.6 (clipped), 6.0      total 7.8
# d loss / d logp (token mean, /6): -A * r on unclipped tokens -> 0, -0.5, -1.1 | 3, 0, 6.
PPO_GRAD = np.array([[0.0, -0.5, -1.1], [3.0, 0.0, 6.0]]) / 6


def test_dual_clip_caps_negative_advantage_tokens():
  # eps_c = 2: the cap is 2 * |A| = 4 on seq 1; only r = 3.0 (loss 6) is capped, to 4.
  loss, m, grad = _value_and_grad(LossConfig(eps_c=2.0))
  np.testing.assert_allclose(loss, (7.8 - 6.0 + 4.0) / 6, rtol=1e-5)
  want = PPO_GRAD.copy()
  want[1, 2] = 0.0  # the capped token has no gradient
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)
  assert m["dual_clip_frac"] == pytest.approx(1 / 6)
  assert m["clip_frac"] == pytest.approx(2 / 6)  # unchanged: the lower/upper clip of PPO
  # eps_c = 1.4: cap 2.8 binds on 3.0 and 6.0 -> loss -2.8 + 2.8 + 1.6 + 2.8 = 4.4.
  loss, m, grad = _value_and_grad(LossConfig(eps_c=1.4))
  np.testing.assert_allclose(loss, 4.4 / 6, rtol=1e-5)
  assert m["dual_clip_frac"] == pytest.approx(2 / 6)
  np.testing.assert_allclose(grad[1], 0.0, atol=1e-7)
  np.testing.assert_allclose(grad[0], PPO_GRAD[0], rtol=1e-5)  # A > 0: untouched


def test_dual_clip_with_tis_the_smaller_bound_binds():
  # tis_cap 2: r = 3.0 -> loss 2 * 2 = 4 (gradient weight 2). eps_c 1.8: cap 3.6 < 4 binds.
  _, m_tis, g_tis = _value_and_grad(LossConfig(tis_cap=2.0))
  loss, m, grad = _value_and_grad(LossConfig(tis_cap=2.0, eps_c=1.8))
  np.testing.assert_allclose(loss, (7.8 - 6.0 + 3.6) / 6, rtol=1e-5)
  np.testing.assert_allclose(g_tis[1, 2], 4.0 / 6, rtol=1e-5)
  assert grad[1, 2] == 0.0
  assert (m["tis_frac"], m["dual_clip_frac"]) == (pytest.approx(1 / 6), pytest.approx(1 / 6))
  # eps_c 2.5: cap 5 > 4, never binds.
  loss, m, grad = _value_and_grad(LossConfig(tis_cap=2.0, eps_c=2.5))
  np.testing.assert_allclose(loss, (7.8 - 6.0 + 4.0) / 6, rtol=1e-5)
  np.testing.assert_allclose(grad, g_tis, rtol=1e-6)
  assert m["dual_clip_frac"] == 0.0


# --- GSPO -----------------------------------------------------------------------------------

# Sequence ratios: row 0 r = 2, 0.5, 1 -> s_0 = (2 * 0.5 * 1)^(1/3) = 1; A = +1, not clipped,
# pg = -1 on each token. Row 1 (two tokens; the third is padding with a wild log-prob)
# r = 0.25, 1 -> s_1 = 0.25^(1/2) = 0.5; A = -2, s_1 < 0.8 so it is clipped: pg = 1.6 per token.
GSPO_RATIOS = np.array([[2.0, 0.5, 1.0], [0.25, 1.0, 1.0]], np.float32)
GSPO_LOGP = BEHAVIOR + np.log(GSPO_RATIOS)
GSPO_LOGP[1, 2] = -1e30  # padding: must not reach the sequence ratio


@pytest.mark.parametrize("level", ["sequence", "sequence_token"])
def test_gspo_hand_values(level):
  cfg = LossConfig(ratio_level=level, aggregation="seq_mean_token_mean")
  loss, m, grad = _value_and_grad(cfg, logp=GSPO_LOGP, mask=MASK5, norm=NORM5)
  # GSPO's objective: the mean over rows of -min(s A, clip(s) A) = (-1 + 1.6) / 2.
  np.testing.assert_allclose(loss, 0.3, rtol=1e-5)
  # Row 0: d loss / d logp_t = (1 / num_seqs) * -A * s_0 / L_0 = (1/2) * -1 * 1/3. (sequence:
  # ds/dlogp_t = s / L, summed over the row's 3 token losses, divided by L; sequence_token:
  # ds_t/dlogp_t = s, divided by L.) Row 1 is clipped: no gradient.
  want = np.array([[-1 / 6] * 3, [0.0] * 3])
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)
  assert m["clip_frac"] == pytest.approx(2 / 5)  # both tokens of the clipped row
  assert m["ratio_mean"] == pytest.approx((3 * 1.0 + 2 * 0.5) / 5, rel=1e-5)
  # approx_kl stays a per-token drift diagnostic: mean of r - 1 - log r over the 5 tokens.
  k3 = [r - 1 - math.log(r) for r in (2.0, 0.5, 1.0, 0.25, 1.0)]
  assert m["approx_kl"] == pytest.approx(sum(k3) / 5, rel=1e-5)


def test_gspo_token_level_would_differ():
  # The same data at token level: r = 2 is clipped at 1.2 -> pg -1.2, -0.5, -1 | 1.6, 2.
  loss, _ = _loss(LossConfig(aggregation="seq_mean_token_mean"), logp=GSPO_LOGP, mask=MASK5)
  np.testing.assert_allclose(loss, ((-1.2 - 0.5 - 1.0) / 3 + (1.6 + 2.0) / 2) / 2, rtol=1e-5)


@pytest.mark.parametrize("aggregation", losses.AGGREGATIONS)
def test_gspo_and_gspo_token_agree_with_one_advantage_per_sequence(aggregation):
  data = tiny.loss_inputs(seed=4, ref_noise=0.8)
  out = []
  for level in ("sequence", "sequence_token"):
    cfg = LossConfig(ratio_level=level, aggregation=aggregation, eps_low=0.05, eps_high=0.05)
    norm = Normalizer.from_mask(data["mask"], max_len=6)
    fn = lambda lp, cfg=cfg, norm=norm: losses.policy_loss(  # noqa: E731
      lp, data["behavior"], data["adv"], data["mask"], config=cfg, norm=norm
    )
    (loss, sums), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(data["logp"]))
    out.append((loss, grad, losses.finalize_metrics(sums)))
  (l_seq, g_seq, m_seq), (l_tok, g_tok, m_tok) = out
  assert 0 < m_seq["clip_frac"] < 1  # some rows clipped, some not: the test has teeth
  np.testing.assert_allclose(l_tok, l_seq, rtol=1e-5)
  np.testing.assert_allclose(g_tok, g_seq, rtol=1e-5, atol=1e-8)
  assert m_tok == pytest.approx(m_seq, rel=1e-5)


def test_sequence_ratio_ignores_padding_and_empty_rows():
  logp = jnp.asarray([[-1.0, -2.0, -1e30], [-1.0, -1.0, -1.0]])
  behavior = jnp.asarray([[-1.5, -1.5, 0.0], [0.0, 0.0, 0.0]])
  mask = jnp.asarray([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
  for level in ("sequence", "sequence_token"):
    log_r = ratios.log_ratio(logp, behavior, mask, level=level)
    # Row 0: (0.5 - 0.5) / 2 = 0 on every position; row 1 (no response tokens): 0.
    np.testing.assert_allclose(log_r, np.zeros((2, 3)), atol=1e-6)


# --- CISPO ------------------------------------------------------------------------------------


def test_cispo_hand_values():
  # Weights sg(clip(r, 0.8, 1.2)): 1.2, 0.8, 1.1 | 1.2, 0.8, 1.2; pg = -w * A:
  #   -1.2, -0.8, -1.1 | 2.4, 1.6, 2.4  -> token mean (6.4 - 3.1) / 6 = 0.55.
  # Gradient -w * A / 6 on every token, the clipped ones included (unlike PPO's zeros).
  loss, m, grad = _value_and_grad(LossConfig(objective="cispo"))
  np.testing.assert_allclose(loss, 3.3 / 6, rtol=1e-5)
  want = np.array([[-1.2, -0.8, -1.1], [2.4, 1.6, 2.4]]) / 6
  np.testing.assert_allclose(grad, want, rtol=1e-5)
  assert m["clip_frac"] == pytest.approx(5 / 6)  # every r outside [0.8, 1.2]
  assert m["pg_loss"] == pytest.approx(0.55, rel=1e-5)


# --- exact micro-batch split, every mode --------------------------------------------------------


MODES = {
  "unscaled": dict(aggregation="seq_mean_token_sum_unscaled"),
  "dr_grpo": dict(aggregation="dr_grpo"),
  "k1_clamp": dict(kl_estimator="k1", kl_clamp=0.3),
  "k2": dict(kl_estimator="k2", aggregation="seq_mean_token_mean"),
  "k3_clamp": dict(kl_estimator="k3", kl_clamp=0.2),
  "dual_clip": dict(eps_c=1.3, tis_cap=1.5),
  "gspo": dict(ratio_level="sequence", aggregation="seq_mean_token_mean", eps_high=0.1),
  "gspo_token_sum": dict(ratio_level="sequence", aggregation="seq_mean_token_sum_unscaled"),
  "gspo_token": dict(ratio_level="sequence_token", eps_c=1.2, eps_low=0.1, eps_high=0.1),
  "cispo": dict(objective="cispo", eps_high=0.1, aggregation="dr_grpo"),
  "cispo_gspo": dict(objective="cispo", ratio_level="sequence"),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_micro_batches_sum_to_mini_batch_loss_and_gradient(mode):
  data = tiny.loss_inputs(seed=1, ref_noise=0.8)
  cfg = LossConfig(**{"kl_coef": 0.05, "entropy_coef": 0.01, **MODES[mode]})
  norm = Normalizer.from_mask(data["mask"], max_len=6)

  def loss_fn(logp, ent, behavior, adv, mask, ref):
    return losses.policy_loss(
      logp, behavior, adv, mask, config=cfg, norm=norm, ref_logp_bt=ref, entropy_bt=ent
    )

  grad_fn = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))
  names = ("logp", "ent", "behavior", "adv", "mask", "ref")
  (loss, sums), (g_logp, g_ent) = grad_fn(*(data[k] for k in names))
  assert np.abs(g_logp).sum() > 0
  for bounds in ([0, 3, 8], [0, 1, 2, 5, 8]):
    total, parts, acc = 0.0, [], None
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
      (part, part_sums), (gl, _) = grad_fn(*(data[k][lo:hi] for k in names))
      total += part
      parts.append(gl)
      acc = part_sums if acc is None else jax.tree.map(jnp.add, acc, part_sums)
    np.testing.assert_allclose(total, loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.concatenate(parts), g_logp, rtol=1e-5, atol=1e-8)
    got, want = losses.finalize_metrics(acc), losses.finalize_metrics(sums)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_modes_change_the_loss():
  # Each mode above computes something other than the default loss on the same batch.
  data = tiny.loss_inputs(seed=1, ref_noise=0.8)
  norm = Normalizer.from_mask(data["mask"], max_len=6)
  args = [jnp.asarray(data[k]) for k in ("logp", "behavior", "adv", "mask")]

  def loss(**kw):
    cfg = LossConfig(**{"kl_coef": 0.05, **kw})
    return float(losses.policy_loss(*args, config=cfg, norm=norm, ref_logp_bt=data["ref"])[0])

  base = loss()
  for mode, kw in MODES.items():
    assert abs(loss(**kw) - base) > 1e-4, mode


def test_extreme_ratios_stay_finite_in_every_mode():
  logp = BEHAVIOR + np.array([[200.0, -200.0, 0.0], [200.0, -200.0, 0.0]], np.float32)
  ref = jnp.asarray(BEHAVIOR)
  for kw in MODES.values():
    cfg = LossConfig(**{"kl_coef": 0.1, **kw})
    fn = lambda lp, cfg=cfg: _loss(cfg, logp=lp, ref_logp_bt=ref)[0]  # noqa: E731
    loss, grad = jax.value_and_grad(fn)(jnp.asarray(logp))
    assert np.isfinite(loss) and np.all(np.isfinite(grad)), kw


# --- config ---------------------------------------------------------------------------------


def test_defaults_are_the_old_loss():
  cfg = LossConfig()
  assert (cfg.objective, cfg.ratio_level, cfg.kl_estimator) == ("ppo", "token", "k3")
  assert cfg.eps_c is None and cfg.kl_clamp is None and cfg.aggregation == "token_mean"


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(eps_c=1.0), "eps_c must be None or > 1"),
    (dict(kl_clamp=0.0), "kl_clamp must be None or > 0"),
    (dict(kl_estimator="k4"), "choose one of: k1, k2, k3"),
    (dict(ratio_level="seq"), "choose one of: token, sequence, sequence_token"),
    (dict(objective="grpo"), "choose one of: ppo, cispo"),
    (dict(objective="cispo", eps_c=2.0), "apply to objective 'ppo' only"),
    (dict(objective="cispo", tis_cap=2.0), "apply to objective 'ppo' only"),
  ],
)
def test_config_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    LossConfig(**kw)


def test_loss_config_fields():
  from knitjax.config_train import LossConfig as LossSection

  t = LossSection()
  assert (t.objective, t.ratio_level, t.kl_estimator, t.eps_c, t.kl_clamp) == (
    "ppo",
    "token",
    "k3",
    0.0,
    0.0,
  )
  for kw, match in [
    (dict(eps_c=0.5), r"config.loss.eps_c=0.5 is not accepted; it must be 0 \(off\) or > 1."),
    (dict(kl_clamp=-1.0), "config.loss.kl_clamp=-1.0 is not accepted"),
    (dict(kl_estimator="k0"), "config.loss.kl_estimator='k0' is not accepted"),
    (dict(ratio_level="tok"), "config.loss.ratio_level='tok' is not accepted"),
    (dict(objective="x"), "config.loss.objective='x' is not accepted"),
    (dict(tis_cap=1.1), "config.loss.tis_cap=1.1 is not accepted"),
    (dict(objective="cispo", eps_c=2.0), "config.loss.eps_c=2.0 is not accepted with"),
  ]:
    with pytest.raises(ValueError, match=match):
      LossSection(**kw)


# --- DAPO overlong penalty ----------------------------------------------------------------------


def test_overlong_penalty_hand_values():
  # max_len 10, buffer 4: 0 up to 6 tokens, then -1/4 per token, -1 at 10 and beyond.
  got = overlong_penalty([0, 5, 6, 7, 8, 9, 10, 12], max_len=10, buffer=4)
  np.testing.assert_allclose(got, [0, 0, 0, -0.25, -0.5, -0.75, -1, -1])
  assert got.dtype == np.float32
  # buffer == max_len: the ramp starts at 0 tokens.
  np.testing.assert_allclose(overlong_penalty(np.array([[0, 2, 4]]), 4, 4), [[0, -0.5, -1]])
  for buffer in (0, 11):
    with pytest.raises(ValueError, match=f"overlong buffer={buffer} is not accepted"):
      overlong_penalty([1], max_len=10, buffer=buffer)
