"""Reward shaping that depends on the response, not on its correctness.

DAPO's overlong penalty (Yu et al., 2025, "soft overlong punishment"), measured in tokens: with
``L`` the response length, ``L_max`` the generation budget and ``c`` the buffer,

  penalty(L) = 0                          if L <= L_max - c
               (L_max - c - L) / c        if L_max - c < L <= L_max   (linear from 0 to -1)
               -1                         if L > L_max

added to the task reward. A response cut off at the budget (``L == L_max``) gets -1.
"""

from collections.abc import Callable, Mapping

import numpy as np


def overlong_penalty(response_lengths, max_len: int, buffer: int) -> np.ndarray:
  """Returns DAPO's soft overlong penalty per response, float32, in ``[-1, 0]``.

  Args:
    response_lengths: response lengths in tokens, any shape.
    max_len: the generation budget ``L_max`` (max_new_tokens), in tokens.
    buffer: the length ``c`` of the linear ramp ending at ``max_len``, in tokens, in
      ``(0, max_len]``.
  """
  if not 0 < buffer <= max_len:
    raise ValueError(
      f"overlong buffer={buffer} is not accepted; it must be in (0, max_len={max_len}]."
    )
  lengths = np.asarray(response_lengths, dtype=np.float32)
  return np.clip((max_len - buffer - lengths) / buffer, -1.0, 0.0).astype(np.float32)


def with_overlong_penalty(
  reward_fn: Callable,
  *,
  max_new_tokens: int,
  class_max_new_tokens: Mapping[str, int],
  buffer: int,
) -> Callable:
  """``reward_fn`` plus DAPO's overlong penalty of the completion's length.

  The budget ``L_max`` of a prompt is its class's token budget (``class_max_new_tokens``), else
  ``max_new_tokens``. The returned function has the reward signature (``prompt``,
  ``completion_ids``, ``tokenizer``) and must get completions trimmed to their length (as
  `knitjax.transfer.assembly.assemble_group` passes them), since the length is what it penalises.
  """
  budgets = dict(class_max_new_tokens)
  for cls, budget in {"": max_new_tokens, **budgets}.items():
    if not 0 < buffer <= budget:
      where = f"class {cls!r}'s budget" if cls else "max_new_tokens"
      raise ValueError(
        f"config.rollout.overlong_buffer={buffer} is not accepted; it must be in (0, {where}="
        f"{budget}]."
      )

  def shaped(prompt, completion_ids, tokenizer) -> float:
    budget = budgets.get(prompt.cls, max_new_tokens)
    penalty = overlong_penalty(len(completion_ids), budget, buffer)
    return float(reward_fn(prompt, completion_ids, tokenizer)) + float(penalty)

  return shaped
