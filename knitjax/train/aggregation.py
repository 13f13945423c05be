"""How per-token loss values become one mini-batch scalar, exactly under micro-batching.

``m`` is the response mask, ``L_i = sum_t m_it`` the response length of row ``i``:

  token_mean                   sum_it x*m / num_tokens
  seq_mean_token_mean          sum_i (sum_t x*m / L_i) / num_seqs
  seq_mean_token_sum_unscaled  sum_it x*m / num_seqs                  (a mean of per-row sums)
  dr_grpo                      sum_it x*m / (num_seqs * max_len)     (Dr. GRPO, Liu et al., 2025)
  seq_mean_token_sum           the same as dr_grpo

``seq_mean_token_sum`` is the name this mode had before the others existed; it keeps the Dr. GRPO
constant ``max_len`` so that configs naming it compute what they always did (verl's
``seq-mean-token-sum`` has no constant: that is ``seq_mean_token_sum_unscaled`` here).

``num_tokens``, ``num_seqs`` and ``max_len`` come from a :class:`Normalizer` computed once for the
whole mini-batch and passed to every micro-batch, so each micro-batch's value is its exact share
and the micro-batch values (and gradients) sum to the mini-batch's. ``L_i`` is a row's own length,
known in any micro-batch because rows are never split. Averaging per-micro-batch token means
instead would change the objective.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

AGGREGATIONS = (
  "token_mean",
  "seq_mean_token_mean",
  "seq_mean_token_sum",
  "seq_mean_token_sum_unscaled",
  "dr_grpo",
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Normalizer:
  """Mini-batch-wide constants of the aggregation; the same for every micro-batch.

  A pytree (all fields are leaves), so it may hold traced values inside a jitted step.

  Attributes:
    num_tokens: response tokens in the whole mini-batch.
    num_seqs: sequences (with at least one response token) in the whole mini-batch.
    max_len: the generation budget (max_new_tokens), Dr. GRPO's constant.
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


def check_aggregation(aggregation: str) -> None:
  """Raises a ValueError naming ``aggregation`` unless it is one of :data:`AGGREGATIONS`."""
  if aggregation not in AGGREGATIONS:
    raise ValueError(
      f"unknown aggregation {aggregation!r}; choose one of: {', '.join(AGGREGATIONS)}."
    )


def aggregate(x_bt: jax.Array, mask_bt: jax.Array, *, aggregation: str, norm: Normalizer):
  """Returns this micro-batch's share of the mini-batch aggregate of per-token values ``x_bt``."""
  check_aggregation(aggregation)
  m = mask_bt.astype(jnp.float32)
  if aggregation == "token_mean":
    return jnp.sum(x_bt * m) / norm.num_tokens
  if aggregation == "seq_mean_token_mean":
    per_seq = jnp.sum(x_bt * m, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0)
    return jnp.sum(per_seq) / norm.num_seqs
  if aggregation == "seq_mean_token_sum_unscaled":
    return jnp.sum(x_bt * m) / norm.num_seqs
  return jnp.sum(x_bt * m) / (norm.num_seqs * norm.max_len)  # dr_grpo, seq_mean_token_sum
