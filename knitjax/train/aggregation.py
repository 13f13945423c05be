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

Packed rows (``knitjax.train.packing``): a sequence holds several rows, told apart by int32
``segment_ids`` (1, 2, ... per row; 0 on padding). Every per-row reduction then becomes a
segment reduction (:func:`row_totals`: ``jax.ops.segment_sum`` over ``[B * (T + 1)]`` static
segments), and ``seq_mean_token_mean`` divides each token by its own row's length, which sums to
the same per-row means; the Normalizer still counts the mini-batch's rows. Loss and gradient are
those of the padded rows (up to float32 summation order).
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
  def from_mask(cls, mask_bt, *, max_len: float, segment_ids_bt=None) -> "Normalizer":
    """Builds the normalizer of a mini-batch from its whole response mask.

    The mask is ``[..., T]``: leading axes (e.g. ``[K, B / K, T]`` micro-batches) all count.
    With ``segment_ids_bt`` (packed rows, same shape) every segment is a row.
    """
    xp = jnp if isinstance(mask_bt, jax.Array) else np
    if segment_ids_bt is None:
      lengths = xp.asarray(mask_bt, dtype=xp.float32).sum(axis=-1)
    else:
      t = mask_bt.shape[-1]
      m = jnp.asarray(mask_bt, jnp.float32).reshape(-1, t)
      lengths = row_totals(m, jnp.asarray(segment_ids_bt).reshape(-1, t))[:, 1:]
      if xp is np:
        lengths = np.asarray(lengths)
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


def row_totals(x_bt: jax.Array, segment_ids_bt: jax.Array) -> jax.Array:
  """``[B, T + 1]``: column ``j`` sums ``x`` over segment ``j`` of each sequence (0: padding).

  Segment ids are in ``[0, T]`` (each row has at least one token), so ``B * (T + 1)`` static
  segments hold every (sequence, segment) pair.
  """
  b, t = x_bt.shape
  flat = jnp.arange(b, dtype=jnp.int32)[:, None] * (t + 1) + segment_ids_bt.astype(jnp.int32)
  sums = jax.ops.segment_sum(x_bt.reshape(-1), flat.reshape(-1), num_segments=b * (t + 1))
  return sums.reshape(b, t + 1)


def row_total_per_token(x_bt: jax.Array, segment_ids_bt: jax.Array | None) -> jax.Array:
  """``[B, T]``: at each token, the sum of ``x`` over its row (its segment when packed)."""
  if segment_ids_bt is None:
    return jnp.broadcast_to(jnp.sum(x_bt, axis=-1, keepdims=True), x_bt.shape)
  totals = row_totals(x_bt, segment_ids_bt)
  return jnp.take_along_axis(totals, segment_ids_bt.astype(jnp.int32), axis=1)


def count_rows(mask_bt: jax.Array, segment_ids_bt: jax.Array | None) -> jax.Array:
  """float32 number of rows (segments when packed) with at least one response token."""
  m = mask_bt.astype(jnp.float32)
  if segment_ids_bt is None:
    return jnp.sum(jnp.sum(m, axis=-1) > 0).astype(jnp.float32)
  return jnp.sum(row_totals(m, segment_ids_bt)[:, 1:] > 0).astype(jnp.float32)


def aggregate(
  x_bt: jax.Array,
  mask_bt: jax.Array,
  *,
  aggregation: str,
  norm: Normalizer,
  segment_ids_bt: jax.Array | None = None,
):
  """Returns this micro-batch's share of the mini-batch aggregate of per-token values ``x_bt``.

  ``segment_ids_bt``: packed rows (see the module docstring); None: one row per sequence.
  """
  check_aggregation(aggregation)
  m = mask_bt.astype(jnp.float32)
  if aggregation == "token_mean":
    return jnp.sum(x_bt * m) / norm.num_tokens
  if aggregation == "seq_mean_token_mean":
    if segment_ids_bt is not None:
      lengths = row_total_per_token(m, segment_ids_bt)
      return jnp.sum(x_bt * m / jnp.maximum(lengths, 1.0)) / norm.num_seqs
    per_seq = jnp.sum(x_bt * m, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0)
    return jnp.sum(per_seq) / norm.num_seqs
  if aggregation == "seq_mean_token_sum_unscaled":
    return jnp.sum(x_bt * m) / norm.num_seqs
  return jnp.sum(x_bt * m) / (norm.num_seqs * norm.max_len)  # dr_grpo, seq_mean_token_sum
