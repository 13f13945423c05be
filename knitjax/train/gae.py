"""Generalized advantage estimation (GAE) over the response tokens of trainer rows.

Per row, over the positions ``t`` whose loss mask ``m_t`` is on (the response tokens; a hole in
the mask, e.g. tool output, is skipped: it neither gets nor passes on a TD error), with token
rewards ``r_t``, old values ``V_t`` and ``t'`` the next position with ``m_t' = 1``:

  delta_t = r_t + gamma * V_t' - V_t        (V_t' = 0 after the row's last response token)
  A_t     = delta_t + gamma * lambda * A_t'  (A_t' = 0 after the last response token)
  R_t     = A_t + V_t                        (the value target: the lambda-return)

Reference: J. Schulman, P. Moritz, S. Levine, M. Jordan, P. Abbeel, "High-Dimensional Continuous
Control Using Generalized Advantage Estimation", ICLR 2016, https://arxiv.org/abs/1506.02438.
The skipping of masked positions follows verl's ``compute_gae_advantage_return``.

Token rewards of a row (``token_rewards``): its sequence reward on its last response token, and,
with the KL penalty as a reward, ``-kl_coef * kl_t`` on every response token (InstructGPT, Ouyang
et al., 2022). ``whiten`` standardises the advantages over every response token of the arrays it
is given, so called once on a whole mini-batch it is the same under any micro-batch split.

All functions take ``[..., T]`` arrays (any leading axes, e.g. ``[K, rows / K, T]``).
"""

import jax
import jax.numpy as jnp


def token_rewards(
  rewards: jax.Array, mask: jax.Array, *, kl: jax.Array | None = None, kl_coef: float = 0.0
) -> jax.Array:
  """Float32 ``[..., T]`` token rewards: ``rewards[...]`` on each row's last response token,
  minus ``kl_coef * kl`` on every response token when ``kl`` is given.

  Args:
    rewards: ``[...]`` one sequence reward per row.
    mask: ``[..., T]`` the loss mask (1 on response tokens).
    kl: ``[..., T]`` per-token KL estimates (stop-gradient), or None.
    kl_coef: the KL penalty's coefficient.
  """
  m = mask.astype(jnp.float32)
  t = m.shape[-1]
  # Index of the last position with m = 1 (a row without one gets no reward: its mask is 0).
  last = (t - 1) - jnp.argmax(m[..., ::-1], axis=-1)
  at_last = jax.nn.one_hot(last, t, dtype=jnp.float32) * m
  out = rewards.astype(jnp.float32)[..., None] * at_last
  if kl is not None:
    out = out - kl_coef * kl.astype(jnp.float32) * m
  return out


def gae(
  rewards: jax.Array, values: jax.Array, mask: jax.Array, *, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
  """Returns ``(advantages, returns)``, float32 ``[..., T]``, 0 where the mask is off.

  Args:
    rewards: ``[..., T]`` token rewards (``token_rewards``).
    values: ``[..., T]`` old values ``V_t`` (stop-gradient).
    mask: ``[..., T]`` the loss mask.
    gamma: discount.
    lam: GAE's lambda (1: Monte Carlo returns minus the value baseline).
  """
  m = mask.astype(jnp.float32)
  r = rewards.astype(jnp.float32)
  v = values.astype(jnp.float32)

  def back(carry, x):
    next_value, next_adv = carry
    r_t, v_t, m_t = x
    adv = r_t + gamma * next_value - v_t + gamma * lam * next_adv
    # A masked position passes its successor's value and advantage through unchanged.
    carry = (m_t * v_t + (1.0 - m_t) * next_value, m_t * adv + (1.0 - m_t) * next_adv)
    return carry, adv * m_t

  time_first = lambda x: jnp.moveaxis(x, -1, 0)  # noqa: E731
  zeros = jnp.zeros(m.shape[:-1], jnp.float32)
  _, adv = jax.lax.scan(
    back, (zeros, zeros), (time_first(r), time_first(v), time_first(m)), reverse=True
  )
  adv = jnp.moveaxis(adv, 0, -1)
  return adv, (adv + v) * m


def whiten(x: jax.Array, mask: jax.Array, *, eps: float = 1e-8) -> jax.Array:
  """``(x - mean) / sqrt(var + eps)`` over the positions where ``mask`` is on (population
  variance), 0 elsewhere; the statistics span every leading axis."""
  m = mask.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(m), 1.0)
  mean = jnp.sum(x * m) / n
  var = jnp.sum(jnp.square(x - mean) * m) / n
  return (x - mean) * jax.lax.rsqrt(var + eps) * m
