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

Packed rows (:mod:`knitjax.train.packing`): a sequence holds several rows, told apart by
``segment_ids`` (1, 2, ... per row, contiguous; 0 on padding). Given them, every row is a segment:
the reverse recursion restarts at each segment's last position (``V_t' = A_t' = 0`` there, as
after a padded row's last response token), so no value or advantage crosses from one row to the
next; and a row's sequence reward, which packing copies to each of its tokens, goes to its
segment's last response token. The arithmetic per position is the padded rows', so packed and
padded advantages agree up to the float32 rounding of the values the model gives each layout.

All functions take ``[..., T]`` arrays (any leading axes, e.g. ``[K, rows / K, T]``).
"""

import jax
import jax.numpy as jnp


def segment_ends(segment_ids: jax.Array) -> jax.Array:
  """Bool ``[..., T]``: True at the last position of each segment (and at every row's end)."""
  after = jnp.concatenate(
    [segment_ids[..., 1:], jnp.full_like(segment_ids[..., :1], -1)], axis=-1
  )  # -1: no segment follows the row's last position
  return segment_ids != after


def last_response_tokens(mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
  """Float32 ``[..., T]``: 1 on the last response token of each row (each segment when
  ``segment_ids`` is given), 0 elsewhere; a row without response tokens has none."""
  m = mask.astype(jnp.float32)
  t = m.shape[-1]
  if segment_ids is None:
    last = (t - 1) - jnp.argmax(m[..., ::-1], axis=-1)
    return jax.nn.one_hot(last, t, dtype=jnp.float32) * m
  # Per (sequence, segment) bin, the largest response position: segment_max over the
  # [B * (T + 1)] bins of knitjax.train.aggregation.row_totals, read back at every token.
  m2, seg = m.reshape(-1, t), segment_ids.reshape(-1, t).astype(jnp.int32)
  b = m2.shape[0]
  bin_ids = jnp.arange(b, dtype=jnp.int32)[:, None] * (t + 1) + seg
  pos = jnp.where(m2 > 0, jnp.arange(t, dtype=jnp.int32)[None, :], -1)
  last = jax.ops.segment_max(pos.reshape(-1), bin_ids.reshape(-1), num_segments=b * (t + 1))
  at_last = (pos == last[bin_ids]) & (m2 > 0)
  return at_last.astype(jnp.float32).reshape(m.shape)


def token_rewards(
  rewards: jax.Array,
  mask: jax.Array,
  *,
  kl: jax.Array | None = None,
  kl_coef: float = 0.0,
  segment_ids: jax.Array | None = None,
) -> jax.Array:
  """Float32 ``[..., T]`` token rewards: each row's sequence reward on its last response token,
  minus ``kl_coef * kl`` on every response token when ``kl`` is given.

  Args:
    rewards: ``[...]`` one sequence reward per row; with ``segment_ids``, ``[..., T]``: each
      token carries its row's reward (as :func:`knitjax.train.packing.pack_batch` lays it out).
    mask: ``[..., T]`` the loss mask (1 on response tokens).
    kl: ``[..., T]`` per-token KL estimates (stop-gradient), or None.
    kl_coef: the KL penalty's coefficient.
    segment_ids: ``[..., T]`` packed rows (see the module docstring); None: one row per
      sequence.
  """
  m = mask.astype(jnp.float32)
  at_last = last_response_tokens(m, segment_ids)
  r = rewards.astype(jnp.float32)
  out = (r if segment_ids is not None else r[..., None]) * at_last
  if kl is not None:
    out = out - kl_coef * kl.astype(jnp.float32) * m
  return out


def gae(
  rewards: jax.Array,
  values: jax.Array,
  mask: jax.Array,
  *,
  gamma: float,
  lam: float,
  segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Returns ``(advantages, returns)``, float32 ``[..., T]``, 0 where the mask is off.

  Args:
    rewards: ``[..., T]`` token rewards (``token_rewards``).
    values: ``[..., T]`` old values ``V_t`` (stop-gradient).
    mask: ``[..., T]`` the loss mask.
    gamma: discount.
    lam: GAE's lambda (1: Monte Carlo returns minus the value baseline).
    segment_ids: ``[..., T]`` packed rows: the recursion restarts at each segment's last
      position; None: one row per sequence.
  """
  m = mask.astype(jnp.float32)
  r = rewards.astype(jnp.float32)
  v = values.astype(jnp.float32)
  # True where the recursion restarts: nothing after a segment's end belongs to its row.
  ends = jnp.zeros(m.shape, bool) if segment_ids is None else segment_ends(segment_ids)

  def back(carry, x):
    r_t, v_t, m_t, end_t = x
    next_value, next_adv = (jnp.where(end_t, 0.0, c) for c in carry)
    adv = r_t + gamma * next_value - v_t + gamma * lam * next_adv
    # A masked position passes its successor's value and advantage through unchanged.
    carry = (m_t * v_t + (1.0 - m_t) * next_value, m_t * adv + (1.0 - m_t) * next_adv)
    return carry, adv * m_t

  time_first = lambda x: jnp.moveaxis(x, -1, 0)  # noqa: E731
  zeros = jnp.zeros(m.shape[:-1], jnp.float32)
  _, adv = jax.lax.scan(
    back,
    (zeros, zeros),
    (time_first(r), time_first(v), time_first(m), time_first(ends)),
    reverse=True,
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
