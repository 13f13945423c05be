"""The policy loss of GRPO-family training (the loss menu), exact under micro-batching.

Per response token ``t`` of sequence ``i`` with advantage ``A_i`` (or ``A_it``: GAE gives one
per token; docs/algorithms.md has the menu with references):

  r     = exp(log-ratio), per token or per sequence    (ratio_level: knitjax.train.ratios)
  pg_t  = -min(r~ * A, clip(r, 1 - eps_low, 1 + eps_high) * A)       (objective "ppo")
  pg_t  = min(pg_t, -eps_c * A) where A < 0                          (dual-clip, eps_c)
  pg_t  = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp_t       (objective "cispo")
  kl_t  = k1, k2 or k3 estimate of KL(pi || pi_ref), maybe clamped   (knitjax.train.kl)
  loss  = agg(pg) + kl_coef * agg(kl) - entropy_coef * agg(entropy)

With ``kl_penalty="reward"`` the KL term leaves the loss (it is subtracted from the rewards before
the advantages instead, ``knitjax.train.step_advantages``); its value is still reported.

``sg`` is stop-gradient; ``agg`` is one of ``knitjax.train.aggregation.AGGREGATIONS``:
``token_mean``, ``seq_mean_token_mean``, ``seq_mean_token_sum_unscaled`` (the mean of per-row
sums) and ``dr_grpo`` (per-row sums over ``num_seqs * max_len``, Dr. GRPO). ``seq_mean_token_sum``
is the old name of ``dr_grpo`` and keeps its meaning, so existing configs compute what they did.

``eps_high > eps_low`` is clip-higher (DAPO, Yu et al., 2025).

Truncated importance sampling (``tis_cap``). Without it ``r~ = r``. With it, ``r~`` has the value
``min(r, tis_cap)`` and the gradient ``min(r, tis_cap) * grad(logp)``: it is computed as
``exp(log r - stop_gradient(max(log r - log tis_cap, 0)))``, i.e. the importance weight of the
policy gradient is truncated at ``tis_cap`` and the truncation itself is a stop-gradient weight
(truncated IS as in IMPALA's rho-bar, Espeholt et al., 2018, and TIS, Yao et al., 2025). Since
``tis_cap >= 1 + eps_high`` is required, it never changes the clip for positive advantages (those
tokens are clipped at ``1 + eps_high`` first); it bounds the tokens plain PPO leaves unbounded:
negative advantage and ``r > tis_cap``, whose loss becomes ``tis_cap * |A|`` with gradient weight
``tis_cap`` instead of ``r``. It matters for stale trajectories, whose behavior policy is several
versions old.

Dual-clip (``eps_c > 1``, Ye et al., 2020) bounds the same tokens another way: their loss is
capped at ``eps_c * |A|`` and their gradient is zero. With both set, the smaller bound binds.

CISPO (MiniMax-M1, 2025) keeps every token's gradient and clips its importance weight instead:
the weight is a stop-gradient, so the loss is computed as ``-sg(w) * A * exp(logp - sg(logp))``,
whose value is ``-w * A`` (comparable with PPO's) and whose gradient is ``-w * A * grad(logp)``.
``eps_c`` and ``tis_cap`` belong to the PPO objective and are refused with CISPO.

Every micro-batch is normalised by the mini-batch's ``Normalizer``, and every per-row quantity
(sequence ratios, ``seq_mean_token_mean``'s lengths) uses the row's own length, so the
micro-batch losses and gradients sum exactly to the mini-batch's. With packed rows
(``segment_ids_bt``, ``knitjax.train.packing``) the per-row quantities are segment reductions and
the advantages come per token, so loss and gradient equal the padded rows'.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from knitjax.train import kl as kl_lib
from knitjax.train import logprobs as logprobs_lib
from knitjax.train import ratios
from knitjax.train.aggregation import (
  AGGREGATIONS,
  Normalizer,
  aggregate,
  check_aggregation,
  count_rows,
)

# The aggregation names are re-exported: callers reach them as losses.Normalizer and so on.
__all__ = [
  "AGGREGATIONS",
  "OBJECTIVES",
  "LossConfig",
  "Normalizer",
  "aggregate",
  "finalize_metrics",
  "policy_loss",
  "token_entropy",
  "token_logprobs",
]

OBJECTIVES = ("ppo", "cispo")
# Where the KL to the reference goes: a loss term, or a penalty on the rewards (computed by the
# step before the advantages, knitjax.train.step_advantages).
KL_PENALTIES = ("loss", "reward")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
  if value not in allowed:
    raise ValueError(f"unknown {name} {value!r}; choose one of: {', '.join(allowed)}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
  """Hyper-parameters of the policy loss (see the module docstring for the formulas).

  ``None`` turns ``tis_cap``, ``eps_c`` and ``kl_clamp`` off; the defaults are PPO-clip with
  token ratios, token-mean aggregation and the k3 KL estimator.
  """

  eps_low: float = 0.2
  eps_high: float = 0.2
  aggregation: str = "token_mean"
  objective: str = "ppo"
  ratio_level: str = "token"
  tis_cap: float | None = None
  eps_c: float | None = None
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  kl_clamp: float | None = None
  kl_penalty: str = "loss"
  entropy_coef: float = 0.0

  def __post_init__(self):
    if not 0.0 <= self.eps_low < 1.0:
      raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}.")
    if not self.eps_high >= 0.0:
      raise ValueError(f"eps_high must be >= 0, got {self.eps_high}.")
    check_aggregation(self.aggregation)
    _choice("objective", self.objective, OBJECTIVES)
    _choice("ratio level", self.ratio_level, ratios.RATIO_LEVELS)
    _choice("kl estimator", self.kl_estimator, kl_lib.KL_ESTIMATORS)
    _choice("kl penalty", self.kl_penalty, KL_PENALTIES)
    if self.tis_cap is not None and not self.tis_cap >= 1.0 + self.eps_high:
      raise ValueError(
        f"tis_cap must be None or >= 1 + eps_high = {1.0 + self.eps_high}, got {self.tis_cap}."
      )
    if self.eps_c is not None and not self.eps_c > 1.0:
      raise ValueError(f"eps_c must be None or > 1, got {self.eps_c}.")
    if self.objective == "cispo" and (self.tis_cap is not None or self.eps_c is not None):
      raise ValueError(
        f"tis_cap={self.tis_cap} and eps_c={self.eps_c} apply to objective 'ppo' only; "
        "set both to None with objective 'cispo'."
      )
    if not self.kl_coef >= 0.0:
      raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}.")
    if self.kl_clamp is not None and not self.kl_clamp > 0.0:
      raise ValueError(f"kl_clamp must be None or > 0, got {self.kl_clamp}.")
    if not self.entropy_coef >= 0.0:
      raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}.")


def token_logprobs(logits_btv: jax.Array, targets_bt: jax.Array, *, temperature: float = 1.0):
  """Returns float32 ``log softmax(logits / temperature)[targets]``, shape ``[B, T]``.

  Use the sampler's temperature so that the log-probs match the behavior log-probs.
  """
  logits = logits_btv.astype(jnp.float32)
  if temperature != 1.0:
    logits = logprobs_lib.tempered(logits, temperature)  # finite at any accepted temperature
  picked = jnp.take_along_axis(logits, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def token_entropy(logits_btv: jax.Array) -> jax.Array:
  """Returns the float32 entropy of ``softmax(logits)`` per position, shape ``[B, T]``."""
  logits = logits_btv.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  probs = jnp.exp(logits - lse[..., None])
  return lse - jnp.sum(probs * logits, axis=-1)


def _ppo(log_r, adv, config: LossConfig):
  """PPO-clip per-token loss with optional TIS and dual-clip; (pg, clipped, tis, dual) tokens."""
  ratio = jnp.exp(log_r)
  clipped = jnp.clip(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
  if config.tis_cap is None:
    is_ratio = ratio
  else:
    excess = jax.lax.stop_gradient(jnp.maximum(log_r - math.log(config.tis_cap), 0.0))
    is_ratio = jnp.exp(log_r - excess)
  pg = -jnp.minimum(is_ratio * adv, clipped * adv)
  clip_tokens = ((adv > 0) & (ratio > 1.0 + config.eps_high)) | (
    (adv < 0) & (ratio < 1.0 - config.eps_low)
  )
  tis_tokens = ratio > config.tis_cap if config.tis_cap is not None else jnp.zeros_like(pg, bool)
  dual_tokens = jnp.zeros_like(pg, bool)
  if config.eps_c is not None:
    cap = -config.eps_c * adv  # eps_c * |A| where A < 0
    dual_tokens = (adv < 0) & (pg > cap)
    pg = jnp.where(dual_tokens, cap, pg)
  return pg, clip_tokens, tis_tokens, dual_tokens


def _cispo(log_r, logp, adv, config: LossConfig):
  """CISPO per-token loss; (pg, tokens whose weight is clipped)."""
  ratio = jnp.exp(log_r)
  weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high))
  pg = -weight * adv * jnp.exp(logp - jax.lax.stop_gradient(logp))
  clip_tokens = (ratio > 1.0 + config.eps_high) | (ratio < 1.0 - config.eps_low)
  return pg, clip_tokens


def policy_loss(
  logp_bt: jax.Array,
  behavior_logp_bt: jax.Array,
  advantages_b: jax.Array,
  mask_bt: jax.Array,
  *,
  config: LossConfig,
  norm: Normalizer,
  ref_logp_bt: jax.Array | None = None,
  entropy_bt: jax.Array | None = None,
  segment_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Returns (this micro-batch's contribution to the mini-batch loss, metric sums).

  Args:
    logp_bt: current policy log-probs of the response tokens (differentiated).
    behavior_logp_bt: the sampler's log-probs of the same tokens.
    advantages_b: one advantage per sequence ``[B]``, or one per token ``[B, T]`` (GAE).
    mask_bt: 1 on response tokens, 0 on prompt and padding. Rows must be whole (sequence ratios
      and per-row lengths are computed from them).
    config: loss hyper-parameters.
    norm: mini-batch-wide constants (see ``Normalizer``).
    ref_logp_bt: frozen reference policy log-probs; required when ``config.kl_coef > 0``.
    entropy_bt: per-token entropy of the current policy; required when
      ``config.entropy_coef > 0``.
    segment_ids_bt: int32 row ids of packed sequences (0 on padding); the advantages are then
      per token. None: one row per sequence.

  Returns:
    The loss contribution (a scalar; summed over micro-batches it is the mini-batch loss) and a
    dict of metric sums over this micro-batch's tokens (``clip_sum``, ``dual_clip_sum``,
    ``tis_sum``, ``approx_kl_sum``, ``ratio_sum``, ``pg_loss_sum``, ``entropy_sum``, ``kl_sum``,
    ``token_sum``, ``seq_sum``); sum them over micro-batches and call ``finalize_metrics``.
    ``entropy_sum`` and ``kl_sum`` are 0 when ``entropy_bt`` / ``ref_logp_bt`` are not given.
  """
  if config.kl_coef > 0 and ref_logp_bt is None:
    raise ValueError(f"kl_coef={config.kl_coef} needs ref_logp_bt, got None.")
  if config.entropy_coef > 0 and entropy_bt is None:
    raise ValueError(f"entropy_coef={config.entropy_coef} needs entropy_bt, got None.")
  agg = lambda x: aggregate(
    x, mask_bt, aggregation=config.aggregation, norm=norm, segment_ids_bt=segment_ids_bt
  )
  m = mask_bt.astype(jnp.float32)
  logp = logp_bt.astype(jnp.float32)
  adv = advantages_b.astype(jnp.float32)
  adv = adv[:, None] if adv.ndim == 1 else adv

  token_log_r = ratios.log_ratio(logp, behavior_logp_bt, mask_bt)
  if config.ratio_level == "token":
    log_r = token_log_r
  else:
    log_r = ratios.log_ratio(
      logp, behavior_logp_bt, mask_bt, level=config.ratio_level, segment_ids_bt=segment_ids_bt
    )
  if config.objective == "cispo":
    pg, clip_tokens = _cispo(log_r, logp, adv, config)
    tis_tokens = dual_tokens = jnp.zeros_like(m, bool)
  else:
    pg, clip_tokens, tis_tokens, dual_tokens = _ppo(log_r, adv, config)
  loss = agg(pg)

  zero = jnp.zeros((), jnp.float32)
  kl_sum = zero
  if ref_logp_bt is not None:
    kl = kl_lib.kl_estimate(logp, ref_logp_bt, estimator=config.kl_estimator, clamp=config.kl_clamp)
    if config.kl_coef > 0 and config.kl_penalty == "loss":
      loss = loss + config.kl_coef * agg(kl)
    kl_sum = jnp.sum(kl * m)
  entropy_sum = zero
  if entropy_bt is not None:
    ent = entropy_bt.astype(jnp.float32)
    if config.entropy_coef > 0:
      loss = loss - config.entropy_coef * agg(ent)
    entropy_sum = jnp.sum(ent * m)

  sums = {
    "clip_sum": jnp.sum(clip_tokens * m),
    "dual_clip_sum": jnp.sum(dual_tokens * m),
    "tis_sum": jnp.sum(tis_tokens * m),
    # k3 estimate of KL(behavior || current) from tokens sampled by the behavior policy, per
    # token whatever the ratio level: a drift diagnostic, not a loss term.
    "approx_kl_sum": jnp.sum((jnp.exp(token_log_r) - 1.0 - token_log_r) * m),
    "ratio_sum": jnp.sum(jnp.exp(log_r) * m),
    "pg_loss_sum": jnp.sum(pg * m),
    "entropy_sum": entropy_sum,
    "kl_sum": kl_sum,
    "token_sum": jnp.sum(m),
    "seq_sum": count_rows(m, segment_ids_bt),
  }
  return loss, jax.lax.stop_gradient(sums)


def finalize_metrics(sums: dict) -> dict[str, float]:
  """Turns metric sums (added over micro-batches) into per-token means, on the host.

  Returns clip_frac (tokens the clip binds on: PPO's sign-aware clip, or CISPO's weight clip),
  dual_clip_frac (tokens whose loss the dual-clip capped), tis_frac, approx_kl, ratio_mean (of
  the ratio the loss uses: the sequence ratio for GSPO), pg_loss, entropy and kl (the configured
  estimator; 0 when not computed), plus num_tokens and num_seqs; with a critic (GAE) also
  value_loss and value_clip_frac (from ``value_loss_sum`` and ``value_clip_sum``).
  """
  sums = {k: float(np.asarray(v)) for k, v in jax.device_get(sums).items()}
  tokens = max(sums["token_sum"], 1.0)
  names = {
    "clip_frac": "clip_sum",
    "dual_clip_frac": "dual_clip_sum",
    "tis_frac": "tis_sum",
    "approx_kl": "approx_kl_sum",
    "ratio_mean": "ratio_sum",
    "pg_loss": "pg_loss_sum",
    "entropy": "entropy_sum",
    "kl": "kl_sum",
    "value_loss": "value_loss_sum",
    "value_clip_frac": "value_clip_sum",
  }
  out = {name: sums[key] / tokens for name, key in names.items() if key in sums}
  out["num_tokens"] = sums["token_sum"]
  out["num_seqs"] = sums["seq_sum"]
  return out
