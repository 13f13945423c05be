"""Reward shaping that depends on the response, not on its correctness.

DAPO's overlong penalty (Yu et al., 2025, "soft overlong punishment"), measured in tokens: with
``L`` the response length, ``L_max`` the generation budget and ``c`` the buffer,

  penalty(L) = 0                          if L <= L_max - c
               (L_max - c - L) / c        if L_max - c < L <= L_max   (linear from 0 to -1)
               -1                         if L > L_max

added to the task reward. A response cut off at the budget (``L == L_max``) gets -1.
"""

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
