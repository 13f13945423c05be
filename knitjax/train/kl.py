"""Per-token estimators of KL(pi || pi_ref) from tokens sampled by pi (Schulman, 2020).

With ``d = log pi_ref(y_t) - log pi(y_t)`` (clamped to +-20 so ``exp`` stays finite):

  k1  -d                   unbiased, high variance, can be negative
  k2  d**2 / 2             biased, low variance, >= 0
  k3  exp(d) - d - 1       unbiased, low variance, >= 0 (the default)

``clamp > 0`` clips the estimate to ``[-clamp, clamp]`` (zero gradient outside), which bounds
what one token far from the reference can contribute (k3 grows like ``exp(d)``).
Reference: J. Schulman, "Approximating KL Divergence", 2020, http://joschu.net/blog/kl-approx.html.
"""

import jax
import jax.numpy as jnp

KL_ESTIMATORS = ("k1", "k2", "k3")
_LOG_RATIO_LIMIT = 20.0


def kl_estimate(
  logp_bt: jax.Array, ref_logp_bt: jax.Array, *, estimator: str = "k3", clamp: float | None = None
) -> jax.Array:
  """Returns the float32 per-token estimate of KL(pi || pi_ref), differentiable in ``logp_bt``."""
  if estimator not in KL_ESTIMATORS:
    raise ValueError(
      f"unknown kl estimator {estimator!r}; choose one of: {', '.join(KL_ESTIMATORS)}."
    )
  d = ref_logp_bt.astype(jnp.float32) - logp_bt.astype(jnp.float32)
  d = jnp.clip(d, -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
  if estimator == "k1":
    kl = -d
  elif estimator == "k2":
    kl = 0.5 * jnp.square(d)
  else:
    kl = jnp.exp(d) - d - 1.0
  if clamp:
    kl = jnp.clip(kl, -clamp, clamp)
  return kl
