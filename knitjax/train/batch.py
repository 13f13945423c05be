"""Host-side assembly of a trainer batch from trajectory rows (NumPy only, vectorised).

A trainer row is ``[left-padded prompt (P) | response right-padded (N)]`` with
``T = P + N``. Position ``t`` predicts token ``t + 1``, so the arrays that score
the response (targets, loss mask, behavior log-probs) are shifted left by one.
Positions come from the valid mask, so left padding never shifts RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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


# Row arrays ``make_batch`` reads (``[R, ...]``; other keys are ignored).
ROW_FIELDS = (
  "prompt_tokens",
  "prompt_lengths",
  "response_tokens",
  "response_mask",
  "response_lengths",
  "logprobs",
)


def pad_rows(
  prompts: Sequence[np.ndarray],
  responses: Sequence[np.ndarray],
  behavior_logps: Sequence[np.ndarray],
) -> dict[str, np.ndarray]:
  """Row arrays of ``make_batch`` from ragged 1-D sequences (every response token carries loss).

  Args:
    prompts: per row, the prompt token ids.
    responses: per row, the generated token ids (EOS included when produced).
    behavior_logps: per row, the sampler's log-prob of each generated token.

  Returns:
    ``ROW_FIELDS`` arrays, right-padded with 0 (``response_mask`` is a prefix of each length).
  """
  for i, (r, lp) in enumerate(zip(responses, behavior_logps, strict=True)):
    if len(lp) != len(r):
      raise ValueError(
        f"row {i} has {len(lp)} log-probs for {len(r)} response tokens; give one per token."
      )
  prompt, prompt_lengths = _right_pad(prompts, np.int32)
  response, response_lengths = _right_pad(responses, np.int32)
  logprobs, _ = _right_pad(behavior_logps, np.float32)
  mask = np.arange(response.shape[1]) < response_lengths[:, None]
  return {
    "prompt_tokens": prompt,
    "prompt_lengths": prompt_lengths,
    "response_tokens": response,
    "response_mask": mask,
    "response_lengths": response_lengths,
    "logprobs": logprobs,
  }


def _right_pad(seqs: Sequence[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
  """``[rows, max length]`` zero-padded, and the lengths (one boolean-mask scatter, no row loop)."""
  lengths = np.array([len(x) for x in seqs], np.int32)
  out = np.zeros((len(seqs), int(lengths.max(initial=0))), dtype)
  if len(seqs):
    out[np.arange(out.shape[1]) < lengths[:, None]] = np.concatenate(
      [np.asarray(x, dtype).reshape(-1) for x in seqs]
    )
  return out, lengths


def _fit_width(x: np.ndarray, width: int) -> np.ndarray:
  """Right-pads with 0 or cuts columns to ``width`` (callers check no kept token is cut)."""
  if x.shape[1] >= width:
    return x[:, :width]
  return np.pad(x, ((0, 0), (0, width - x.shape[1])))


def make_batch(
  rows: Mapping[str, np.ndarray],
  advantages: np.ndarray,
  *,
  prompt_len: int,
  max_new_tokens: int,
  pad_id: int,
  rewards: np.ndarray | None = None,
  group_ids: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
  """Builds the arrays of one mini-batch from row arrays (rows in the given order).

  A position inside a response whose ``response_mask`` is off (e.g. tool output) stays a valid
  token the model attends to, but gets ``loss_mask`` 0 and ``behavior_logp`` 0.

  Args:
    rows: ``ROW_FIELDS`` arrays: ``prompt_tokens`` ``[R, P']`` right-padded, ``prompt_lengths``
      ``[R]``, ``response_tokens``, ``response_mask`` and ``logprobs`` ``[R, N']``,
      ``response_lengths`` ``[R]`` (e.g. from ``pad_rows`` or the storage's ``stack_rows``).
    advantages: ``[R]`` advantage per row.
    prompt_len: ``P``, the padded prompt length.
    max_new_tokens: ``N``, the padded response length.
    pad_id: padding token id.
    rewards: ``[R]`` sequence reward per row (the step recomputes advantages from them for GAE
      or the KL as a reward); None: zeros.
    group_ids: ``[R]`` the group of each row (rows of a group share it); None: one group per row.

  Returns:
    ``tokens, positions, valid, targets, loss_mask, behavior_logp`` of shape ``[R, P + N]``
    (left-padded prompt | right-padded response) and ``advantages``, ``rewards`` (float32) and
    ``group_id`` (int32) of shape ``[R]``.

  Raises:
    ValueError: a field is missing or mis-shaped, or a prompt or response does not fit.
  """
  missing = [f for f in ROW_FIELDS if f not in rows]
  if missing:
    raise ValueError(f"make_batch rows lack {missing}; accepted: a mapping with all of ROW_FIELDS.")
  x = {
    name: np.asarray(rows[name], dtype)
    for name, dtype in zip(
      ROW_FIELDS, (np.int32, np.int64, np.int32, bool, np.int64, np.float32), strict=True
    )
  }
  r = len(x["prompt_lengths"]) if x["prompt_lengths"].ndim == 1 else -1
  p_width = x["prompt_tokens"].shape[-1] if x["prompt_tokens"].ndim == 2 else -1
  n_width = x["response_tokens"].shape[-1] if x["response_tokens"].ndim == 2 else -1
  want = {
    "prompt_tokens": (r, p_width),
    "prompt_lengths": (r,),
    "response_tokens": (r, n_width),
    "response_mask": (r, n_width),
    "response_lengths": (r,),
    "logprobs": (r, n_width),
  }
  for name, shape in want.items():
    if x[name].shape != shape or min(shape) < 0:
      raise ValueError(
        f"make_batch rows: {name} has shape {list(x[name].shape)}; accepted: "
        f"[R, width] token arrays and [R] lengths, one row each (R={r})."
      )
  for kind, lengths, width, limit, bound in (
    ("prompt", x["prompt_lengths"], p_width, "prompt_len", prompt_len),
    ("response", x["response_lengths"], n_width, "max_new_tokens", max_new_tokens),
  ):
    if (bad := (lengths < 0) | (lengths > width)).any():
      i = int(np.argmax(bad))
      raise ValueError(
        f"row {i}: {kind} length {lengths[i]} is outside [0, {width}], its row's width."
      )
    if (bad := lengths > bound).any():
      i = int(np.argmax(bad))
      raise ValueError(f"row {i}: {kind} of {lengths[i]} tokens does not fit {limit}={bound}.")
  prompt, prompt_lengths = x["prompt_tokens"], x["prompt_lengths"]
  response, response_lengths = x["response_tokens"], x["response_lengths"]
  response_mask, logprobs = x["response_mask"], x["logprobs"]

  # Left-pad the prompts: output column j holds prompt token j - (P - length).
  src = np.arange(prompt_len)[None, :] - (prompt_len - prompt_lengths)[:, None]
  in_prompt = src >= 0
  prompt = _fit_width(prompt, prompt_len)
  prompt_bp = np.where(in_prompt, np.take_along_axis(prompt, np.maximum(src, 0), axis=1), pad_id)
  in_response = np.arange(max_new_tokens)[None, :] < response_lengths[:, None]
  response_bn = np.where(in_response, _fit_width(response, max_new_tokens), pad_id)
  carries_loss = in_response & _fit_width(response_mask, max_new_tokens)

  t = prompt_len + max_new_tokens
  tokens = np.concatenate([prompt_bp, response_bn], axis=1).astype(np.int32)
  valid = np.concatenate([in_prompt, in_response], axis=1)
  # Position prompt_len - 1 + k predicts response token k.
  loss_mask = np.zeros((r, t), np.float32)
  loss_mask[:, prompt_len - 1 : t - 1] = carries_loss
  behavior = np.zeros((r, t), np.float32)
  behavior[:, prompt_len - 1 : t - 1] = np.where(
    carries_loss, _fit_width(logprobs, max_new_tokens), np.float32(0.0)
  )
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
  targets = np.concatenate([tokens[:, 1:], np.full((r, 1), pad_id, np.int32)], axis=1)
  return {
    "tokens": tokens,
    "positions": positions,
    "valid": valid,
    "targets": targets,
    "loss_mask": loss_mask,
    "behavior_logp": behavior,
    "advantages": np.asarray(advantages, np.float32).reshape(r),
    "rewards": np.asarray(np.zeros(r) if rewards is None else rewards, np.float32).reshape(r),
    "group_id": np.asarray(np.arange(r) if group_ids is None else group_ids, np.int32).reshape(r),
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
