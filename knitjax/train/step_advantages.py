"""Advantages computed inside the jitted train step, over the whole mini-batch at once.

The host computes group advantages from the rewards alone (``knitjax.transfer.access``). Two
cases need the model, so the step computes them before its micro-batch scan, from forward
passes with the step's current params (stop-gradient) over every micro-batch:

- ``estimator="gae"`` (PPO with a critic): the old values ``V_old`` of every position; token
  rewards (the sequence reward on the last response token, minus ``kl_coef * kl_t`` on every
  response token with the KL as a reward); GAE per row (:mod:`knitjax.train.gae`); advantages
  whitened over the mini-batch's response tokens; returns ``R = A + V_old`` (before whitening)
  are the critic's targets.
- a group estimator with the KL as a reward: ``reward_i - kl_coef * sum_t kl_it`` per row, then
  the group estimator by segment ops over the rows' group ids
  (:func:`knitjax.train.advantages.segment_advantages`; a group's rows are always in one
  mini-batch).

The KL is estimated from the current policy's log-probs (stop-gradient: the params this update
starts from, verl's "old log-probs") and the reference's, with the configured estimator and
clamp. Everything here spans the whole ``[K, rows / K, T]`` mini-batch, so the advantages do not
depend on the micro-batch split.

Packed rows (:mod:`knitjax.train.packing`, a ``segment_ids`` field): every row is a segment of a
``[K, S / K, pack_len]`` sequence and its ``rewards`` and ``group_id`` are copied to each of its
tokens. GAE restarts at each segment's end (:mod:`knitjax.train.gae`); the group estimators run
over the ``S * (pack_len + 1)`` (sequence, segment) bins of
:func:`knitjax.train.aggregation.row_totals`, one per row plus empty ones that form a group of
their own, and the advantages go back to every token of the row. The results are the padded
rows' (up to float32 summation order). The bins cost one sort of ``S * (pack_len + 1)`` group
ids (``segment_advantages``' ``jnp.unique``), small next to the forward passes these advantages
already need.

Shared prompts (:mod:`knitjax.train.prompt_sharing`): laid out like packed rows, one segment per
response; a group's prompt is a segment of its own, named by its responses' ``prefix_ids``, which
is no row: it joins the empty bins.
"""

import dataclasses

import jax
import jax.numpy as jnp

from knitjax.train import gae as gae_lib
from knitjax.train import value_loss
from knitjax.train.advantages import ESTIMATORS, segment_advantages
from knitjax.train.aggregation import row_totals

# The host's group estimators, and PPO's generalized advantage estimation with a critic.
ADVANTAGES = (*ESTIMATORS, "gae")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
  """How the step's advantages are made (see the module docstring).

  Attributes:
    estimator: a group estimator (``grpo``, ``drgrpo``, ``rloo``) or ``gae``.
    gamma: GAE's discount.
    gae_lambda: GAE's lambda.
    whiten: standardise GAE advantages over the mini-batch's response tokens.
    value_coef: weight of the value loss (GAE).
    value_clip: clip of the value loss around the old values (GAE); None: unclipped.
  """

  estimator: str = "grpo"
  gamma: float = 1.0
  gae_lambda: float = 1.0
  whiten: bool = True
  value_coef: float = 0.1
  value_clip: float | None = 0.2

  def __post_init__(self):
    if self.estimator not in ADVANTAGES:
      raise ValueError(
        f"unknown advantage {self.estimator!r}; choose one of: {', '.join(ADVANTAGES)}."
      )
    for name in ("gamma", "gae_lambda"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}.")
    if self.estimator == "gae" and not self.value_coef > 0.0:
      raise ValueError(f"value_coef must be > 0 with the gae advantage, got {self.value_coef}.")
    if self.value_clip is not None and not self.value_clip > 0.0:
      raise ValueError(f"value_clip must be None or > 0, got {self.value_clip}.")

  @property
  def critic(self) -> bool:
    """Whether the policy model has a value head trained by this step."""
    return self.estimator == "gae"


def compute(
  batch: dict[str, jax.Array],
  *,
  config: AdvantageConfig,
  old_values: jax.Array | None,
  kl: jax.Array | None,
  kl_coef: float,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """The mini-batch's advantages (and, with a critic, returns), and scalar metrics.

  Args:
    batch: ``[K, rows / K, ...]`` arrays with ``loss_mask``, ``rewards`` and ``group_id``; packed:
      ``[K, S / K, pack_len]`` arrays and ``segment_ids`` (see the module docstring).
    config: the advantage settings.
    old_values: ``[K, rows / K, T]`` stop-gradient values (``gae``), else None.
    kl: ``[K, rows / K, T]`` stop-gradient KL estimates when the KL is a reward, else None.
    kl_coef: the KL penalty's coefficient.

  Returns:
    ``{"advantages": ..., "returns": ..., "old_values": ...}`` (the last two with gae only) to
    replace the batch's fields, advantages ``[K, rows / K, T]`` with gae or packed rows, else
    ``[K, rows / K]``; and metrics (``returns_mean``, ``values_mean``, ``explained_variance``
    with gae; ``kl_reward_penalty``, the mean per-row ``kl_coef * sum_t kl_t``, when the KL is a
    reward).
  """
  mask = batch["loss_mask"].astype(jnp.float32)
  segments = batch.get("segment_ids")
  metrics = {}
  if kl is not None:
    if segments is None:
      seq_penalty = kl_coef * jnp.sum(kl * mask, axis=-1)
      rows = jnp.sum(mask, axis=-1) > 0
    else:  # per (sequence, segment) bin; column 0 is the padding's
      t = mask.shape[-1]
      flat = segments.reshape(-1, t)
      seq_penalty = kl_coef * row_totals((kl * mask).reshape(-1, t), flat)
      rows = (row_totals(mask.reshape(-1, t), flat) > 0).at[:, 0].set(False)
    metrics["kl_reward_penalty"] = jnp.sum(seq_penalty * rows) / jnp.maximum(jnp.sum(rows), 1)
  if config.critic:
    if old_values is None:
      raise ValueError("the gae advantage needs old_values from a model with a value head.")
    rewards = gae_lib.token_rewards(
      batch["rewards"], mask, kl=kl, kl_coef=kl_coef, segment_ids=segments
    )
    adv, returns = gae_lib.gae(
      rewards, old_values, mask, gamma=config.gamma, lam=config.gae_lambda, segment_ids=segments
    )
    if config.whiten:
      adv = gae_lib.whiten(adv, mask)
    tokens = jnp.maximum(jnp.sum(mask), 1.0)
    metrics["returns_mean"] = jnp.sum(returns * mask) / tokens
    metrics["values_mean"] = jnp.sum(old_values * mask) / tokens
    metrics["explained_variance"] = value_loss.explained_variance(old_values, returns, mask)
    new = {"advantages": adv, "returns": returns, "old_values": old_values * mask}
    return jax.lax.stop_gradient(new), metrics
  if segments is not None:
    adv = _packed_group_advantages(batch, segments, seq_penalty if kl is not None else None, config)
    return {"advantages": jax.lax.stop_gradient(adv)}, metrics
  rewards = batch["rewards"].astype(jnp.float32)
  if kl is not None:
    rewards = rewards - seq_penalty
  adv = segment_advantages(
    rewards.reshape(-1), batch["group_id"].reshape(-1), config.estimator
  ).reshape(rewards.shape)
  return {"advantages": jax.lax.stop_gradient(adv)}, metrics


def _packed_group_advantages(
  batch: dict[str, jax.Array],
  segments: jax.Array,
  penalty: jax.Array | None,
  config: AdvantageConfig,
) -> jax.Array:
  """A group estimator over packed rows: ``[..., T]`` advantages, each row's on its tokens.

  ``penalty``: ``[B, T + 1]`` per-bin KL penalties (``compute``'s), or None.
  """
  t = segments.shape[-1]
  seg = segments.reshape(-1, t).astype(jnp.int32)
  # A row's first token: its reward and group id, summed once into its bin (exact: one term).
  first = (seg > 0) & (seg != jnp.pad(seg, ((0, 0), (1, 0)))[:, :-1])
  rows = row_totals(first.astype(jnp.int32), seg) > 0
  if "prefix_ids" in batch:  # shared prompts: a prompt's segment is no row (it has no response)
    prefix = batch["prefix_ids"].reshape(-1, t).astype(jnp.int32)
    b = jnp.arange(seg.shape[0])[:, None]
    rows = rows & ~jnp.zeros(rows.shape, bool).at[b, prefix].max(prefix > 0)
  reward = row_totals(
    jnp.where(first, batch["rewards"].reshape(-1, t), 0.0).astype(jnp.float32), seg
  )
  if penalty is not None:
    reward = reward - penalty
  group = row_totals(jnp.where(first, batch["group_id"].reshape(-1, t), 0), seg)
  # Empty bins: one group of their own below every real id, reward 0, so advantage 0.
  empty = jnp.min(jnp.where(rows, group, jnp.iinfo(group.dtype).max)) - 1
  adv = segment_advantages(
    jnp.where(rows, reward, 0.0).reshape(-1),
    jnp.where(rows, group, empty).reshape(-1),
    config.estimator,
  ).reshape(rows.shape)
  per_token = jnp.take_along_axis(adv, seg, axis=1) * (seg > 0)
  return per_token.reshape(segments.shape)
