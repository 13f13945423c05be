"""Host-side assembly of a trainer batch from trajectories (NumPy only).

A trainer row is ``[left-padded prompt (P) | response right-padded (N)]`` with
``T = P + N``. Position ``t`` predicts token ``t + 1``, so the arrays that score
the response (targets, loss mask, behavior log-probs) are shifted left by one.
Positions come from the valid mask, so left padding never shifts RoPE.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BATCH_FIELDS = ("tokens", "positions", "valid", "targets", "loss_mask", "behavior_logp")


def left_pad(
  prompts: Sequence[np.ndarray], length: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads 1-D prompts to ``length``; returns ``(prompts_bp, lengths_b)``."""
  out = np.full((len(prompts), length), pad_id, np.int32)
  lens = np.zeros((len(prompts),), np.int32)
  for i, p in enumerate(prompts):
    if len(p) > length:
      raise ValueError(f"prompt {i} has {len(p)} tokens, over the prompt length {length}.")
    if len(p):
      out[i, length - len(p) :] = p
    lens[i] = len(p)
  return out, lens


def make_batch(
  prompts: Sequence[np.ndarray],
  responses: Sequence[np.ndarray],
  behavior_logps: Sequence[np.ndarray],
  advantages: np.ndarray,
  *,
  prompt_len: int,
  max_new_tokens: int,
  pad_id: int,
) -> dict[str, np.ndarray]:
  """Builds the arrays of one mini-batch (rows in the given order).

  Args:
    prompts: per row, the prompt token ids (1-D).
    responses: per row, the generated token ids (1-D, EOS included when produced).
    behavior_logps: per row, the sampler's log-prob of each generated token.
    advantages: ``[rows]`` advantage per row.
    prompt_len: ``P``, the padded prompt length.
    max_new_tokens: ``N``, the padded response length.
    pad_id: padding token id.

  Returns:
    ``tokens, positions, valid, targets, loss_mask, behavior_logp`` of shape
    ``[rows, P + N]`` and ``advantages`` of shape ``[rows]``.
  """
  rows = len(prompts)
  t = prompt_len + max_new_tokens
  tokens, _ = left_pad(prompts, prompt_len, pad_id)
  tokens = np.concatenate([tokens, np.full((rows, max_new_tokens), pad_id, np.int32)], axis=1)
  valid = np.zeros((rows, t), bool)
  loss_mask = np.zeros((rows, t), np.float32)
  behavior = np.zeros((rows, t), np.float32)
  for i, (p, r, lp) in enumerate(zip(prompts, responses, behavior_logps, strict=True)):
    n = len(r)
    if n > max_new_tokens or len(lp) != n:
      raise ValueError(
        f"row {i}: response of {n} tokens with {len(lp)} log-probs does not fit "
        f"max_new_tokens={max_new_tokens}."
      )
    tokens[i, prompt_len : prompt_len + n] = r
    valid[i, prompt_len - len(p) : prompt_len + n] = True
    # Position prompt_len - 1 + k predicts response token k.
    loss_mask[i, prompt_len - 1 : prompt_len - 1 + n] = 1.0
    behavior[i, prompt_len - 1 : prompt_len - 1 + n] = lp
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
  targets = np.concatenate([tokens[:, 1:], np.full((rows, 1), pad_id, np.int32)], axis=1)
  return {
    "tokens": tokens,
    "positions": positions,
    "valid": valid,
    "targets": targets,
    "loss_mask": loss_mask,
    "behavior_logp": behavior,
    "advantages": np.asarray(advantages, np.float32).reshape(rows),
  }


def split_micro_batches(batch: dict[str, np.ndarray], micro_batches: int) -> dict[str, np.ndarray]:
  """Reshapes every ``[rows, ...]`` array to ``[micro_batches, rows / micro_batches, ...]``."""
  rows = len(batch["advantages"])
  if rows % micro_batches:
    raise ValueError(
      f"a mini-batch of {rows} sequences cannot be split into {micro_batches} equal micro-batches."
    )
  return {
    k: v.reshape(micro_batches, rows // micro_batches, *v.shape[1:]) for k, v in batch.items()
  }
