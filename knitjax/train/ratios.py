"""Importance ratios of the policy loss, per token or per sequence (GSPO, Zheng et al., 2025).

Each level returns a ``[B, T]`` log-ratio; the loss takes ``r = exp(log-ratio)`` per token. With
``d_t = logp_t - behavior_logp_t`` and ``L_i`` the response length of row ``i``:

  token           log r_it = d_it                                    (PPO, GRPO)
  sequence        log r_it = log s_i = sum_t m_it d_it / L_i        (GSPO)
  sequence_token  log r_it = sg(log s_i) + logp_it - sg(logp_it)     (GSPO-token)

``sg`` is stop-gradient. GSPO's ``s_i`` is the length-normalised sequence ratio; its gradient
reaches every token of the row as ``s_i / L_i``. GSPO-token has the value ``s_i`` on every token
and the gradient ``s_i`` per token; with one advantage per sequence (all this package has) and an
aggregation that weighs a row's tokens equally (all of them), the two give the same loss, and the
same gradients wherever the +-20 clamp below does not bind (the paper's remark, checked by a
test). Where it binds they differ: ``sequence`` clamps ``log s_i`` itself, so no gradient passes
through a clamped row, while ``sequence_token`` adds its per-token term outside the clamp. ``L_i``
is a row's own length, so the ratio is the same in every micro-batch split. The log-ratio is
clamped to +-20 so ``exp`` stays finite. With packed rows (``segment_ids_bt``) ``s_i`` is a
segment's, broadcast to its tokens."""

import jax
import jax.numpy as jnp

from knitjax.train.aggregation import row_total_per_token

RATIO_LEVELS = ("token", "sequence", "sequence_token")
# exp(20) ~ 5e8: far past any clip or cap, yet finite in float32 (and so are its gradients).
LOG_RATIO_LIMIT = 20.0


def log_ratio(
  logp_bt: jax.Array,
  behavior_logp_bt: jax.Array,
  mask_bt: jax.Array,
  *,
  level: str = "token",
  segment_ids_bt: jax.Array | None = None,
) -> jax.Array:
  """Returns the float32 ``[B, T]`` log importance ratio of ``level`` (see the module docstring).

  ``segment_ids_bt``: packed rows (``knitjax.train.packing``); None: one row per sequence.
  """
  if level not in RATIO_LEVELS:
    raise ValueError(f"unknown ratio level {level!r}; choose one of: {', '.join(RATIO_LEVELS)}.")
  logp = logp_bt.astype(jnp.float32)
  d = logp - behavior_logp_bt.astype(jnp.float32)
  if level == "token":
    return jnp.clip(d, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
  m = mask_bt.astype(jnp.float32)
  # where, not d * m: padding may hold any log-prob, and inf * 0 is nan.
  d_masked = jnp.where(m > 0, d, 0.0)
  if segment_ids_bt is None:
    per_row = jnp.sum(d_masked, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0)
    log_s = jnp.clip(per_row, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)[:, None]
  else:  # each token gets its own row's ratio
    per_token = row_total_per_token(d_masked, segment_ids_bt) / jnp.maximum(
      row_total_per_token(m, segment_ids_bt), 1.0
    )
    log_s = jnp.clip(per_token, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
  if level == "sequence":
    return jnp.broadcast_to(log_s, d.shape)
  return jax.lax.stop_gradient(log_s) + logp - jax.lax.stop_gradient(logp)
