"""Group-relative advantage estimators: one advantage per response, from its group's rewards.

Each takes rewards ``[num_groups, G]`` (the ``G`` responses of one prompt in a row) and returns
advantages of the same shape, float32, in the same array library (NumPy in, NumPy out; jax in,
jax out) so the runtime can compute them on the host or inside a jitted step.

- ``grpo``: ``(r - mean) / (std + eps)`` per group, population std (ddof 0), as in DeepSeekMath
  (Shao et al., 2024).
- ``drgrpo``: ``r - mean``; Dr. GRPO (Liu et al., 2025) drops the std division, which over-weights
  groups with nearly equal rewards.
- ``rloo``: ``r_i - mean_{j != i} r_j`` = ``G / (G - 1) * (r_i - mean)``; the leave-one-out
  baseline (Kool et al., 2019; Ahmadian et al., 2024) is independent of the response it scores.

A group whose rewards are all equal gets zero advantages under every estimator.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _xp(rewards_gn: Any):
  return jnp if isinstance(rewards_gn, jax.Array) else np


def grpo(rewards_gn, *, eps: float = 1e-6):
  """GRPO: rewards standardised within each group."""
  xp = _xp(rewards_gn)
  mean = rewards_gn.mean(axis=1, keepdims=True)
  std = rewards_gn.std(axis=1, keepdims=True)
  return ((rewards_gn - mean) / (std + eps)).astype(xp.float32)


def drgrpo(rewards_gn, *, eps: float = 1e-6):
  """Dr. GRPO: rewards minus the group mean (``eps`` unused)."""
  del eps
  xp = _xp(rewards_gn)
  return (rewards_gn - rewards_gn.mean(axis=1, keepdims=True)).astype(xp.float32)


def rloo(rewards_gn, *, eps: float = 1e-6):
  """RLOO: each reward minus the mean of the other G - 1 rewards of its group (``eps`` unused)."""
  del eps
  xp = _xp(rewards_gn)
  g = rewards_gn.shape[1]
  if g < 2:
    raise ValueError(f"rloo needs at least 2 responses per group, got G={g}.")
  others_mean = (rewards_gn.sum(axis=1, keepdims=True) - rewards_gn) / (g - 1)
  return (rewards_gn - others_mean).astype(xp.float32)


ESTIMATORS: dict[str, Callable[..., Any]] = {"grpo": grpo, "drgrpo": drgrpo, "rloo": rloo}


def compute_advantages(rewards_gn, estimator: str, *, eps: float = 1e-6):
  """Returns advantages ``[num_groups, G]`` (float32) for rewards ``[num_groups, G]``.

  Args:
    rewards_gn: rewards, one row per group; NumPy or jax array.
    estimator: a key of ``ESTIMATORS``.
    eps: added to the std in ``grpo`` so that equal-reward groups give 0, not NaN.
  """
  if estimator not in ESTIMATORS:
    raise ValueError(
      f"unknown advantage estimator {estimator!r}; choose one of: {', '.join(ESTIMATORS)}."
    )
  xp = _xp(rewards_gn)
  # NumPy computes in float64; jax in float32 (its default without x64).
  rewards_gn = xp.asarray(rewards_gn, dtype=xp.float64 if xp is np else xp.float32)
  if rewards_gn.ndim != 2:
    raise ValueError(f"rewards must have shape [num_groups, G], got shape {rewards_gn.shape}.")
  adv = ESTIMATORS[estimator](rewards_gn, eps=eps)
  # Rounding in the mean would give equal-reward groups tiny (and, under grpo, rescaled)
  # advantages; such groups carry no signal, so zero them exactly.
  has_signal = rewards_gn.max(axis=1, keepdims=True) > rewards_gn.min(axis=1, keepdims=True)
  return xp.where(has_signal, adv, 0.0).astype(xp.float32)


def reward_metrics(rewards_gn) -> dict[str, float]:
  """Returns reward_mean, reward_std and frac_groups_with_signal (groups whose rewards differ).

  Groups whose rewards are all equal get zero advantages and carry no learning signal, so their
  fraction is the first thing to watch when learning stalls.
  """
  r = np.asarray(jax.device_get(rewards_gn), dtype=np.float64)
  if r.ndim != 2 or r.size == 0:
    raise ValueError(f"rewards must have shape [num_groups, G] with G >= 1, got {r.shape}.")
  signal = (r.max(axis=1) > r.min(axis=1)).mean()
  return {
    "reward_mean": float(r.mean()),
    "reward_std": float(r.std()),
    "frac_groups_with_signal": float(signal),
  }


def segment_advantages(rewards_r, group_ids_r, estimator: str, *, eps: float = 1e-6):
  """The group estimators on flat rows (jax, jittable): rows of a group share a group id.

  Equals :func:`compute_advantages` on the same rewards laid out ``[num_groups, G]`` (the
  statistics of each group come from segment sums instead of a row of the array), so a jitted
  step can recompute advantages after changing rewards (the KL penalty as a reward). Rows may
  come in any order and groups may have different sizes; ``rloo`` needs every group to have at
  least 2 rows (a 1-row group's advantage is then 0, as its rewards carry no signal).

  Args:
    rewards_r: ``[R]`` one reward per row.
    group_ids_r: ``[R]`` int group id per row (any ints; only equality matters).
    estimator: a key of ``ESTIMATORS``.
    eps: added to the std in ``grpo``.

  Returns:
    ``[R]`` float32 advantages.
  """
  if estimator not in ESTIMATORS:
    raise ValueError(
      f"unknown advantage estimator {estimator!r}; choose one of: {', '.join(ESTIMATORS)}."
    )
  r = jnp.asarray(rewards_r, jnp.float32)
  n_rows = r.shape[0]
  _, seg = jnp.unique(jnp.asarray(group_ids_r), size=n_rows, return_inverse=True)
  seg = seg.reshape(n_rows)
  segment_sum = lambda x: jax.ops.segment_sum(x, seg, num_segments=n_rows)  # noqa: E731
  count = segment_sum(jnp.ones_like(r))[seg]
  total = segment_sum(r)[seg]
  mean = total / count
  if estimator == "grpo":
    std = jnp.sqrt(segment_sum(jnp.square(r - mean))[seg] / count)
    adv = (r - mean) / (std + eps)
  elif estimator == "drgrpo":
    adv = r - mean
  else:  # rloo
    adv = r - (total - r) / jnp.maximum(count - 1.0, 1.0)
  high = jax.ops.segment_max(r, seg, num_segments=n_rows)[seg]
  low = jax.ops.segment_min(r, seg, num_segments=n_rows)[seg]
  return jnp.where(high > low, adv, 0.0).astype(jnp.float32)
