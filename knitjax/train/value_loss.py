"""The critic's loss: PPO2's clipped value loss, and the explained variance of the old values.

Per response token, with the value ``V`` (differentiated), the old value ``V_old`` (stop-gradient,
computed before the update), the return ``R`` and the clip ``eps``:

  V_clip = V_old + clip(V - V_old, -eps, eps)
  loss_t = 0.5 * max((V - R)**2, (V_clip - R)**2)        (eps = None: 0.5 * (V - R)**2)

as in OpenAI baselines' PPO2 and verl (the 0.5 makes the gradient ``V - R``). The clip keeps one
update from moving a value further than ``eps`` from ``V_old``. Reference: J. Schulman et al.,
"Proximal Policy Optimization Algorithms", 2017 (the value term of eq. 9), and baselines'
``ppo2/model.py``.

Explained variance ``1 - Var(R - V_old) / Var(R)`` over the response tokens says how much of the
returns the critic predicts: 1 is perfect, 0 is no better than a constant, negative is worse.
"""

import jax
import jax.numpy as jnp


def value_loss(
  values: jax.Array,
  old_values: jax.Array,
  returns: jax.Array,
  *,
  clip: float | None,
) -> tuple[jax.Array, jax.Array]:
  """Per-token clipped value loss and where the clipped term binds (both ``[..., T]``).

  The caller masks and aggregates the loss (the policy loss's aggregation and Normalizer).
  """
  v = values.astype(jnp.float32)
  r = returns.astype(jnp.float32)
  unclipped = jnp.square(v - r)
  if clip is None:
    return 0.5 * unclipped, jnp.zeros_like(v, bool)
  old = old_values.astype(jnp.float32)
  clipped = jnp.square(old + jnp.clip(v - old, -clip, clip) - r)
  return 0.5 * jnp.maximum(unclipped, clipped), clipped > unclipped


def explained_variance(values: jax.Array, returns: jax.Array, mask: jax.Array) -> jax.Array:
  """``1 - Var(R - V) / Var(R)`` over the positions where ``mask`` is on (0 if Var(R) = 0)."""
  m = mask.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(m), 1.0)

  def var(x):
    mean = jnp.sum(x * m) / n
    return jnp.sum(jnp.square(x - mean) * m) / n

  var_r = var(returns.astype(jnp.float32))
  ratio = var(returns.astype(jnp.float32) - values.astype(jnp.float32)) / jnp.maximum(var_r, 1e-12)
  return jnp.where(var_r > 0, 1.0 - ratio, 0.0)
