"""A group's prompt computed once per mini-batch, its responses in any micro-batches: exact.

The shared-prompt layout (:mod:`knitjax.train.prompt_sharing`) puts a whole group in one
sequence, so a group never spans micro-batches: its ``P + G N`` tokens must fit one row, and a
mini-batch needs at least micro-batches x shards groups. This layout keeps the padded layout's
rows and takes only the prompt out of them, as :mod:`knitjax.train.dedup` takes the images out:

1. **Prompts once.** Each prompt's first ``P - 1`` columns (the **prefix**, left-padded as in its
   padded row) run once per mini-batch through the model, ``jax.vjp`` of
   :meth:`~knitjax.models.transformer.Transformer.keys_values`: every layer's keys and values
   ``[L, U, P - 1, K, H]`` of the mini-batch's U prompts, and the residuals of their backward.
2. **Rows continue them.** A row keeps its padded row's columns ``[P - 1, P + N - 1)``: the
   prompt's last token, then the response but its last column, which scores nothing (position
   ``t`` predicts token ``t + 1``; the last response token is only a target) and which no
   scored position attends to: ``N`` columns, the width of the response (block sizes that suit
   the responses suit the rows). Its ``prefix_index`` names its prompt; every micro-batch
   gathers its rows' prefix keys and values (:func:`attach`; the gather's transpose scatter-adds)
   and the model attends each row over them and its own causal span
   (`knitjax.models.attention.SequenceMask.past_k`). Positions, targets, loss mask and row fields
   are the padded row's own columns, so the first response token is scored inside the row (from
   the prompt's last token) and no scoring moves.
3. **Cotangent accumulated.** The loss's cotangent w.r.t. the prefix keys and values is summed in
   float32 over all K micro-batches, next to the parameters' gradient
   (`knitjax.train.accumulation`).
4. **One prompt backward.** The sum goes back through the prompt forward once (the one
   ``vjp`` call), and its parameter gradient is added to the micro-batches'.

Why exact: a prompt position attends only to earlier prompt positions, so its keys and values
are the same in every padded row of its group; a row's positions see exactly those and their own,
at the same slots and RoPE positions. The loss is a sum over micro-batches, and the prompt
forward's backward is linear in its cotangent, so one backward of the summed cotangent is the sum
of the K backwards the padded layout runs per row. Loss, metrics and gradients equal the padded
layout's up to float32 summation order (``tests/train/test_prefix.py``), whatever micro-batches
a group's rows fall in.

Memory: the U prompts' keys and values and their float32 cotangent, ``3 x 2 L U (P - 1) K H``
numbers, plus the prompt forward's residuals (U prompt rows' activations) live across the
micro-batch scan; each micro-batch gathers ``[L, B, P - 1, K, H]`` keys and values for its B
rows, the size of its padded rows' prompt keys and values. Attention per row is about ``N (P +
N / 2)`` causal scores, those of the padded row's last ``N`` query rows.

Host side: ``prefix_tokens``, ``prefix_positions``, ``prefix_valid`` ``[U, P - 1]`` are the
mini-batch's prompts (``slots`` of them, a static count; unused slots empty), not split into
micro-batches; the ``[R, N]`` row fields and ``prefix_index`` ``[R]`` are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from knitjax.train import accumulation
from knitjax.train import batch as batch_lib

# The mini-batch's prompts, [U, P - 1] each: laid out once, not split into micro-batches.
PROMPT_FIELDS = ("prefix_tokens", "prefix_positions", "prefix_valid")
# A VLM's: each prompt's image, [U] (an index into the mini-batch's unique images; -1: none).
PROMPT_IMAGE_FIELD = "prefix_image_index"
_ALL_PROMPT_FIELDS = (*PROMPT_FIELDS, PROMPT_IMAGE_FIELD)
# Each row's prompt: an index into them ([R], -1: none).
INDEX_FIELD = "prefix_index"

PyTree = Any


# ---- host side: the layout ----------------------------------------------------------------------


def prompt_units(batch: Mapping[str, np.ndarray], prompt_len: int) -> list[list[int]]:
  """The rows of each prompt, in row order: rows of one group whose prefixes (columns
  ``[0, P - 1)``, tokens and validity) are equal share one; a row whose prompt differs from its
  group's gets its own."""
  tokens, valid = np.asarray(batch["tokens"]), np.asarray(batch["valid"], bool)
  group = np.asarray(batch["group_id"]).reshape(-1)
  s = prompt_len - 1
  units: dict[tuple, list[int]] = {}
  for r in range(len(group)):
    key = (int(group[r]), tokens[r, :s].tobytes(), valid[r, :s].tobytes())
    units.setdefault(key, []).append(r)
  return list(units.values())


def prefix_batch(
  batch: Mapping[str, np.ndarray], *, prompt_len: int, slots: int
) -> dict[str, np.ndarray]:
  """Lays a padded mini-batch out as prompts once and rows that continue them (module docstring).

  Args:
    batch: :func:`~knitjax.train.batch.make_batch` arrays (``[R, P + N]`` token fields, ``[R]``
      or per-token row fields).
    prompt_len: ``P``, the padded prompt width (at least 2).
    slots: ``U``, the prompt count laid out (unused slots are empty prompts no row names).

  Returns:
    The ``[R, N]`` token fields (the padded rows' columns ``[P - 1, P + N - 1)``), the other row
    fields unchanged, ``prefix_index`` ``[R]`` and the ``PROMPT_FIELDS`` ``[U, P - 1]`` (a VLM
    batch, with ``image_index``: also ``prefix_image_index`` ``[U]``, each prompt's image; its
    image tokens must sit in the prefix, not in the prompt's last column).

  Raises:
    ValueError: ``prompt_len`` < 2, or the rows hold more than ``slots`` prompts.
  """
  if prompt_len < 2:
    raise ValueError(f"a prompt prefix needs a prompt width of at least 2, got {prompt_len}.")
  width = np.asarray(batch["tokens"]).shape[1]
  units = prompt_units(batch, prompt_len)
  if len(units) > slots:
    raise ValueError(
      f"the mini-batch's rows hold {len(units)} distinct prompts, more than the layout's {slots} "
      "prompt slots (one per group); use config.layout.prompt_sharing 'group' or 'off' for "
      "groups whose rows hold different prompts."
    )
  s = prompt_len - 1
  out = {}
  for key, value in batch.items():
    value = np.asarray(value)
    out[key] = value[:, s : width - 1] if value.ndim == 2 and value.shape[1] == width else value
  first = np.array([u[0] for u in units], np.int64)
  index = np.full(len(np.asarray(batch["group_id"]).reshape(-1)), -1, np.int32)
  for u, rows in enumerate(units):
    index[rows] = u
  out[INDEX_FIELD] = index
  for field, name in zip(PROMPT_FIELDS, ("tokens", "positions", "valid"), strict=True):
    column = np.asarray(batch[name])[:, :s]
    slot = np.zeros((slots, s), column.dtype)
    slot[: len(units)] = column[first]
    out[field] = slot
  if "image_index" in batch:
    image = np.full(slots, -1, np.int32)
    image[: len(units)] = np.asarray(batch["image_index"])[first]
    out[PROMPT_IMAGE_FIELD] = image
  return out


def prefix_metrics(
  padded_tokens: float, prompt_tokens: float, row_tokens: float, rows: int, prompts: int
) -> dict[str, float]:
  """The layout's token counts, named as the shared layout's (`prompt_sharing.sharing_metrics`):
  ``share_padded_tokens`` (``G (P + R)`` a group), ``share_tokens`` (``P - 1 + G R`` at most),
  their ratio, ``share_rows`` and ``share_prompts`` (the distinct prompts run once)."""
  tokens = prompt_tokens + row_tokens
  return {
    "share_padded_tokens": float(padded_tokens),
    "share_tokens": float(tokens),
    "share_token_ratio": padded_tokens / max(tokens, 1.0),
    "share_rows": float(rows),
    "share_prompts": float(prompts),
  }


def split_micro_batches(batch: Mapping[str, np.ndarray], k: int) -> dict[str, np.ndarray]:
  """``[K, rows / K, ...]`` row fields (`knitjax.train.batch.split_micro_batches`); the prompts
  stay whole: every micro-batch reads them."""
  rows = {key: v for key, v in batch.items() if key not in _ALL_PROMPT_FIELDS}
  prompts = {key: batch[key] for key in _ALL_PROMPT_FIELDS if key in batch}
  return {**batch_lib.split_micro_batches(rows, k), **prompts}


@dataclasses.dataclass(frozen=True)
class PrefixSpec:
  """How a trainer lays out each mini-batch with its prompts once (:func:`prefix_batch`).

  Attributes:
    prompt_len: the padded prompt width of the mini-batches.
    slots: prompts laid out per mini-batch: its groups (a static count), rounded up to a
      multiple of the batch shards.
  """

  prompt_len: int
  slots: int

  def with_metrics(
    self, batch: Mapping[str, np.ndarray], *, count: int = 0
  ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The layout and its :func:`prefix_metrics`; ``count``: the row count planned
    (:meth:`plan_parts`; 0: the rows'), which the layout never changes."""
    rows = len(np.asarray(batch["group_id"]).reshape(-1))
    if count and count != rows:
      raise ValueError(f"a prompt-prefix layout keeps its {rows} rows; count={count} was asked.")
    out = prefix_batch(batch, prompt_len=self.prompt_len, slots=self.slots)
    prompts = int(out[INDEX_FIELD].max(initial=-1)) + 1
    return out, prefix_metrics(
      np.count_nonzero(batch["valid"]),
      np.count_nonzero(out["prefix_valid"]),
      np.count_nonzero(out["valid"]),
      rows,
      prompts,
    )

  def plan_parts(
    self, parts: Sequence[Sequence[tuple[Sequence[int], Sequence[int]]]], *, row_len: int
  ) -> tuple[int, dict[str, float]]:
    """The rows each consumer keeps (the most of any part) and the whole mini-batch's metrics
    from the groups' token counts alone (a group with equal prompt lengths taken to share its
    prompt)."""
    n = row_len - self.prompt_len  # the response width: a row drops its last column
    padded = prompt = row = rows = prompts = 0
    count = max((sum(len(p) for p, _ in groups) for groups in parts), default=0)
    for groups in parts:
      for p_tokens, r_tokens in groups:
        shares = len(set(p_tokens)) == 1
        for p, r in zip(p_tokens, r_tokens, strict=True):
          padded += p + r
          row += min(p, 1) + min(r, n - 1)
        rows += len(p_tokens)
        prompts += 1 if shares else len(p_tokens)
        prompt += max(p_tokens[0] - 1, 0) if shares else sum(max(p - 1, 0) for p in p_tokens)
    return count, prefix_metrics(padded, prompt, row, rows, prompts)


# ---- device side: the step's math ---------------------------------------------------------------


def split(batch: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], dict[str, jax.Array] | None]:
  """``(row fields, the prompts)``; the prompts are None for a batch of another layout."""
  if PROMPT_FIELDS[0] not in batch:
    return batch, None
  rows = {k: v for k, v in batch.items() if k not in _ALL_PROMPT_FIELDS}
  return rows, {k: batch[k] for k in _ALL_PROMPT_FIELDS if k in batch}


def prompt_kv(graphdef: nnx.GraphDef, params: nnx.State, prompts: dict[str, jax.Array]) -> dict:
  """``{"k", "v"}``: every layer's keys and values ``[L, U, P - 1, K, H]`` of the prompts."""
  model = nnx.merge(graphdef, params)
  k, v = model.keys_values(
    prompts["prefix_tokens"], prompts["prefix_positions"], prompts["prefix_valid"]
  )
  return {"k": k, "v": v}


def attach(
  mb: dict[str, jax.Array], kv_u: dict | None, prompts: dict[str, jax.Array] | None
) -> dict[str, jax.Array]:
  """The micro-batch with its rows' prompt keys and values gathered (``past_k``, ``past_v``
  ``[L, B, P - 1, K, H]``, ``past_valid`` ``[B, P - 1]``), which `knitjax.train.step.forward`
  hands the model (`SequenceMask.past_k`). The gather's transpose scatter-adds each row's
  cotangent into its prompt's; a row naming no prompt (-1) sees no valid past key, so its
  cotangent there is zero. Unchanged without prompts."""
  if kv_u is None:
    return mb
  index = mb[INDEX_FIELD].astype(jnp.int32)
  at = jnp.maximum(index, 0)
  valid = jnp.take(prompts["prefix_valid"].astype(jnp.bool_), at, axis=0) & (index >= 0)[:, None]
  return {
    **mb,
    "past_k": jnp.take(kv_u["k"], at, axis=1),
    "past_v": jnp.take(kv_u["v"], at, axis=1),
    "past_valid": valid,
  }


def value_and_grad(
  prompt_fn: Callable[[PyTree], dict],
  loss_fn: Callable[[PyTree, dict, dict], tuple[jax.Array, dict]],
  params: PyTree,
  micro_batches: dict[str, jax.Array],
) -> tuple[jax.Array, dict, PyTree]:
  """Loss, metric sums and gradient of a mini-batch whose micro-batches share its prompts.

  Args:
    prompt_fn: ``params -> kv_u``, the prompts' keys and values (:func:`prompt_kv`).
    loss_fn: ``(params, kv_u, micro_batch) -> (loss, metric sums)``; it reads its rows' prompt
      keys and values through :func:`attach`.
    params: the differentiated params (with LoRA the adapters; the functions combine the base).
    micro_batches: ``[K, ...]`` row fields, scanned over the leading axis.

  Returns:
    ``(loss, metric sums, gradient)``: summed over the K micro-batches
    (`knitjax.train.accumulation`), the gradient through the prompts' one backward included.
  """
  kv_u, backward = jax.vjp(prompt_fn, params)
  loss, sums, grads, ct = accumulation.value_and_grad(loss_fn, params, kv_u, micro_batches)
  (g_prompts,) = backward(jax.tree.map(lambda c, x: c.astype(x.dtype), ct, kv_u))
  return loss, sums, jax.tree.map(jnp.add, grads, g_prompts)
