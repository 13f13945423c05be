"""PPO-clip policy loss for GRPO-family training, exact under micro-batching.

Per response token ``t`` of sequence ``i`` with advantage ``A_i``:

  ratio  r = exp(logp - behavior_logp)        (log-ratio clamped to +-20 so exp stays finite)
  pg_t   = -min(r~ * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
  kl_t   = exp(ref - logp) - (ref - logp) - 1  (k3 estimator of KL(pi || pi_ref), Schulman 2020)
  loss   = agg(pg) + kl_coef * agg(kl) - entropy_coef * agg(entropy)

``eps_high > eps_low`` is clip-higher (DAPO, Yu et al., 2025).

Truncated importance sampling (``tis_cap``). Without it ``r~ = r``. With it, ``r~`` has the value
``min(r, tis_cap)`` and the gradient ``min(r, tis_cap) * grad(logp)``: it is computed as
``exp(log r - stop_gradient(max(log r - log tis_cap, 0)))``, i.e. the importance weight of the
policy gradient is truncated at ``tis_cap`` and the truncation itself is a stop-gradient weight
(truncated IS as in IMPALA's rho-bar, Espeholt et al., 2018, and TIS, Yao et al., 2025). Since
``tis_cap >= 1 + eps_high`` is required, it never changes the clip for positive advantages (those
tokens are clipped at ``1 + eps_high`` first); it bounds the tokens plain PPO leaves unbounded:
negative advantage and ``r > tis_cap``, whose loss becomes ``tis_cap * |A|`` with gradient weight
``tis_cap`` instead of ``r``. This is a soft dual-clip (Ye et al., 2020): dual-clip zeroes the
gradient of those tokens, TIS keeps it at the cap. It matters for stale trajectories, whose
behavior policy is several versions old.

Aggregation ``agg`` over a mini-batch (``m`` the response mask, ``L_i = sum_t m_it``):

  token_mean            sum_it x*m / num_tokens
  seq_mean_token_mean   sum_i (sum_t x*m / L_i) / num_seqs
  seq_mean_token_sum    sum_it x*m / (num_seqs * max_len)      (Dr. GRPO, Liu et al., 2025)

``num_tokens``, ``num_seqs`` and ``max_len`` come from a ``Normalizer`` computed once for the
whole mini-batch and passed to every micro-batch, so each micro-batch's loss is its exact share
and the micro-batch losses (and gradients) sum to the mini-batch's. Averaging per-micro-batch
token means instead would change the objective.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
# exp(20) ~ 5e8: far past any clip or cap, yet finite in float32 (and so are its gradients).
_LOG_RATIO_LIMIT = 20.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
  """Hyper-parameters of the policy loss (see the module docstring for the formulas)."""

  eps_low: float = 0.2
  eps_high: float = 0.2
  aggregation: str = "token_mean"
  tis_cap: float | None = None
  kl_coef: float = 0.0
  entropy_coef: float = 0.0

  def __post_init__(self):
    if not 0.0 <= self.eps_low < 1.0:
      raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}.")
    if not self.eps_high >= 0.0:
      raise ValueError(f"eps_high must be >= 0, got {self.eps_high}.")
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(
        f"unknown aggregation {self.aggregation!r}; choose one of: {', '.join(AGGREGATIONS)}."
      )
    if self.tis_cap is not None and not self.tis_cap >= 1.0 + self.eps_high:
      raise ValueError(
        f"tis_cap must be None or >= 1 + eps_high = {1.0 + self.eps_high}, got {self.tis_cap}."
      )
    if not self.kl_coef >= 0.0:
      raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}.")
    if not self.entropy_coef >= 0.0:
      raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}.")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Normalizer:
  """Mini-batch-wide constants of the aggregation; the same for every micro-batch.

  A pytree (all fields are leaves), so it may hold traced values inside a jitted step.

  Attributes:
    num_tokens: response tokens in the whole mini-batch.
    num_seqs: sequences (with at least one response token) in the whole mini-batch.
    max_len: the generation budget (max_new_tokens), Dr. GRPO's constant for seq_mean_token_sum.
  """

  num_tokens: float | jax.Array
  num_seqs: float | jax.Array
  max_len: float | jax.Array

  def __post_init__(self):
    # Only concrete numbers can be checked; traced or placeholder leaves pass through.
    for name in ("num_tokens", "num_seqs", "max_len"):
      value = getattr(self, name)
      if isinstance(value, int | float | np.number) and not value > 0:
        raise ValueError(f"Normalizer.{name} must be > 0, got {value}.")

  @classmethod
  def from_mask(cls, mask_bt, *, max_len: float) -> "Normalizer":
    """Builds the normalizer of a mini-batch from its whole response mask.

    The mask is ``[..., T]``: leading axes (e.g. ``[K, B / K, T]`` micro-batches) all count.
    """
    xp = jnp if isinstance(mask_bt, jax.Array) else np
    lengths = xp.asarray(mask_bt, dtype=xp.float32).sum(axis=-1)
    return cls(
      num_tokens=lengths.sum(),
      num_seqs=(lengths > 0).sum().astype(xp.float32),
      max_len=max_len,
    )


def token_logprobs(logits_btv: jax.Array, targets_bt: jax.Array, *, temperature: float = 1.0):
  """Returns float32 ``log softmax(logits / temperature)[targets]``, shape ``[B, T]``.

  Use the sampler's temperature so that the log-probs match the behavior log-probs.
  """
  logits = logits_btv.astype(jnp.float32)
  if temperature != 1.0:
    logits = logits / temperature
  picked = jnp.take_along_axis(logits, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def token_entropy(logits_btv: jax.Array) -> jax.Array:
  """Returns the float32 entropy of ``softmax(logits)`` per position, shape ``[B, T]``."""
  logits = logits_btv.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  probs = jnp.exp(logits - lse[..., None])
  return lse - jnp.sum(probs * logits, axis=-1)


def aggregate(x_bt: jax.Array, mask_bt: jax.Array, *, aggregation: str, norm: Normalizer):
  """Returns this micro-batch's share of the mini-batch aggregate of per-token values ``x_bt``."""
  m = mask_bt.astype(jnp.float32)
  if aggregation == "token_mean":
    return jnp.sum(x_bt * m) / norm.num_tokens
  if aggregation == "seq_mean_token_mean":
    per_seq = jnp.sum(x_bt * m, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0)
    return jnp.sum(per_seq) / norm.num_seqs
  if aggregation == "seq_mean_token_sum":
    return jnp.sum(x_bt * m) / (norm.num_seqs * norm.max_len)
  raise ValueError(
    f"unknown aggregation {aggregation!r}; choose one of: {', '.join(AGGREGATIONS)}."
  )


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
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Returns (this micro-batch's contribution to the mini-batch loss, metric sums).

  Args:
    logp_bt: current policy log-probs of the response tokens (differentiated).
    behavior_logp_bt: the sampler's log-probs of the same tokens.
    advantages_b: one advantage per sequence.
    mask_bt: 1 on response tokens, 0 on prompt and padding.
    config: loss hyper-parameters.
    norm: mini-batch-wide constants (see ``Normalizer``).
    ref_logp_bt: frozen reference policy log-probs; required when ``config.kl_coef > 0``.
    entropy_bt: per-token entropy of the current policy; required when
      ``config.entropy_coef > 0``.

  Returns:
    The loss contribution (a scalar; summed over micro-batches it is the mini-batch loss) and a
    dict of metric sums over this micro-batch's tokens (``clip_sum``, ``tis_sum``,
    ``approx_kl_sum``, ``ratio_sum``, ``pg_loss_sum``, ``entropy_sum``, ``kl_sum``, ``token_sum``,
    ``seq_sum``); sum them over micro-batches and call ``finalize_metrics``. ``entropy_sum`` and
    ``kl_sum`` are 0 when ``entropy_bt`` / ``ref_logp_bt`` are not given.
  """
  if config.kl_coef > 0 and ref_logp_bt is None:
    raise ValueError(f"kl_coef={config.kl_coef} needs ref_logp_bt, got None.")
  if config.entropy_coef > 0 and entropy_bt is None:
    raise ValueError(f"entropy_coef={config.entropy_coef} needs entropy_bt, got None.")
  agg = lambda x: aggregate(x, mask_bt, aggregation=config.aggregation, norm=norm)
  m = mask_bt.astype(jnp.float32)
  logp = logp_bt.astype(jnp.float32)
  adv = advantages_b.astype(jnp.float32)[:, None]

  log_ratio = jnp.clip(
    logp - behavior_logp_bt.astype(jnp.float32), -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT
  )
  ratio = jnp.exp(log_ratio)
  clipped = jnp.clip(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
  if config.tis_cap is None:
    is_ratio = ratio
  else:
    excess = jax.lax.stop_gradient(jnp.maximum(log_ratio - math.log(config.tis_cap), 0.0))
    is_ratio = jnp.exp(log_ratio - excess)
  pg = -jnp.minimum(is_ratio * adv, clipped * adv)
  loss = agg(pg)

  zero = jnp.zeros((), jnp.float32)
  kl_sum = zero
  if ref_logp_bt is not None:
    d = jnp.clip(ref_logp_bt.astype(jnp.float32) - logp, -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    kl = jnp.exp(d) - d - 1.0
    if config.kl_coef > 0:
      loss = loss + config.kl_coef * agg(kl)
    kl_sum = jnp.sum(kl * m)
  entropy_sum = zero
  if entropy_bt is not None:
    ent = entropy_bt.astype(jnp.float32)
    if config.entropy_coef > 0:
      loss = loss - config.entropy_coef * agg(ent)
    entropy_sum = jnp.sum(ent * m)

  clipped_tokens = ((adv > 0) & (ratio > 1.0 + config.eps_high)) | (
    (adv < 0) & (ratio < 1.0 - config.eps_low)
  )
  tis_tokens = ratio > config.tis_cap if config.tis_cap is not None else jnp.zeros_like(m, bool)
  sums = {
    "clip_sum": jnp.sum(clipped_tokens * m),
    "tis_sum": jnp.sum(tis_tokens * m),
    # k3 estimate of KL(behavior || current) from tokens sampled by the behavior policy.
    "approx_kl_sum": jnp.sum((ratio - 1.0 - log_ratio) * m),
    "ratio_sum": jnp.sum(ratio * m),
    "pg_loss_sum": jnp.sum(pg * m),
    "entropy_sum": entropy_sum,
    "kl_sum": kl_sum,
    "token_sum": jnp.sum(m),
    "seq_sum": jnp.sum(jnp.sum(m, axis=-1) > 0).astype(jnp.float32),
  }
  return loss, jax.lax.stop_gradient(sums)


def finalize_metrics(sums: dict) -> dict[str, float]:
  """Turns metric sums (added over micro-batches) into per-token means, on the host.

  Returns clip_frac, tis_frac, approx_kl, ratio_mean, pg_loss, entropy and kl (0 when not
  computed), plus num_tokens and num_seqs.
  """
  sums = {k: float(np.asarray(v)) for k, v in jax.device_get(sums).items()}
  tokens = max(sums["token_sum"], 1.0)
  names = {
    "clip_frac": "clip_sum",
    "tis_frac": "tis_sum",
    "approx_kl": "approx_kl_sum",
    "ratio_mean": "ratio_sum",
    "pg_loss": "pg_loss_sum",
    "entropy": "entropy_sum",
    "kl": "kl_sum",
  }
  out = {name: sums[key] / tokens for name, key in names.items()}
  out["num_tokens"] = sums["token_sum"]
  out["num_seqs"] = sums["seq_sum"]
  return out
