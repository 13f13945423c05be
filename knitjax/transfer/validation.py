"""Validation of a group payload where it enters a storage unit (the one place it is checked).

A group's input payload is a mapping from field name to NumPy arrays, one row per sample (``G``
samples, ``N`` the padded response width):

- ``prompt_tokens`` (required): int32 ``[G, P]``, or a sequence of ``G`` 1-D int32 arrays (ragged
  prompts); every prompt has at least 1 token.
- ``response_tokens`` (required): int32 ``[G, N]``, right-padded, ``N >= 1``.
- ``response_mask``: bool ``[G, N]``, the tokens that carry loss; False from the response length on.
  It may have holes inside the response (e.g. tool output in a multi-turn response): those tokens
  stay in the sequence but carry no loss.
- ``response_lengths``: int32 ``[G]``, ``0 <= length <= N``. At least one of mask and lengths is
  given; the other is derived (lengths: last masked position + 1; mask: a prefix of the length).
- ``logprobs`` (required): float32 ``[G, N]``, behavior log-probs; finite and ``<= 0`` where the
  mask is on.
- ``rewards`` (required): float32 ``[G]``, finite.
- ``ref_logprobs``: float32 ``[G, N]``, finite and ``<= 0`` where the mask is on.
- ``image_index``: int32 ``[G]``, index into the group's ``K`` images, ``0 <= index < K``.

Every token id (prompt, and response including its padding, since consumers embed whole padded
rows) must lie in ``[0, vocab_size)``; ``prompt_len + response_len <= max_seq_len`` per sample and
``P, N <= max_seq_len``. Images (``K`` of them, shared by the group's samples) are uint8, float16
or float32 arrays ``[H, W]`` or ``[H, W, C]``, finite, at most ``max_image_bytes`` each.

Normalised (stored) form, a frozen :class:`~knitjax.transfer.payload.GroupPayload`:
``prompt_tokens`` right-padded with 0 to ``[G, P_max]`` plus a derived ``prompt_lengths`` int32
``[G]``; both ``response_mask`` and ``response_lengths``; log-probs set to 0.0 where the mask is
off, so a padded position can never put a NaN into a loss. Arrays are private, contiguous,
read-only copies.
"""

from collections.abc import Mapping, Sequence

import numpy as np

from knitjax.transfer.payload import (
  INPUT_FIELDS,
  REQUIRED_FIELDS,
  GroupPayload,
)

# Reasons a payload is rejected; the keys of ``StorageUnit.stats()["rejected"]``.
REJECT_REASONS = (
  "unknown_field",
  "missing_field",
  "dtype",
  "shape",
  "non_finite",
  "token_range",
  "value_range",
  "too_long",
  "too_large",
  "duplicate",
)


_IMAGE_DTYPES = (np.dtype(np.uint8), np.dtype(np.float16), np.dtype(np.float32))


class PayloadError(ValueError):
  """A payload broke the schema; ``field`` and ``reason`` (one of REJECT_REASONS) say how."""

  def __init__(self, group_id, field: str, reason: str, message: str):
    super().__init__(f"group {group_id}: field '{field}' {message}")
    self.group_id = group_id
    self.field = field
    self.reason = reason
    self.message = message

  def __reduce__(self):  # pickles with its fields (Ray sends it from a storage actor)
    return (PayloadError, (self.group_id, self.field, self.reason, self.message))


def _check_array(gid, name: str, x, dtype, shape: tuple) -> np.ndarray:
  """Checks type, dtype and shape (``None`` entries of ``shape`` are free)."""
  if not isinstance(x, np.ndarray):
    raise PayloadError(gid, name, "dtype", f"is a {type(x).__name__}; accepted: a np.ndarray.")
  if x.dtype != dtype:
    raise PayloadError(gid, name, "dtype", f"has dtype {x.dtype}; accepted: {np.dtype(dtype)}.")
  ok = x.ndim == len(shape) and all(
    s is None or s == d for s, d in zip(shape, x.shape, strict=True)
  )
  if not ok:
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    raise PayloadError(gid, name, "shape", f"has shape {list(x.shape)}; accepted: {want}.")
  return x


def _check_tokens(gid, name: str, x: np.ndarray, vocab_size: int, row_offset: int = 0) -> None:
  bad = (x < 0) | (x >= vocab_size)
  if bad.any():
    idx = np.argwhere(bad)[0]
    raise PayloadError(
      gid,
      name,
      "token_range",
      f"has token id {int(x[tuple(idx)])} at sample {int(idx[0]) + row_offset}"
      f"{f' position {int(idx[1])}' if len(idx) > 1 else ''}; accepted: ids in [0, {vocab_size}).",
    )


def _prompts(gid, x, vocab_size: int, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Returns (padded [G, P_max] int32, lengths [G] int32)."""
  if isinstance(x, np.ndarray):
    _check_array(gid, "prompt_tokens", x, np.int32, (None, None))
    rows = list(x)
  elif isinstance(x, Sequence) and not isinstance(x, str | bytes):
    rows = [_check_array(gid, "prompt_tokens", r, np.int32, (None,)) for r in x]
  else:
    raise PayloadError(
      gid,
      "prompt_tokens",
      "dtype",
      f"is a {type(x).__name__}; accepted: int32 [G, P] or a sequence of 1-D int32 arrays.",
    )
  if not rows:
    raise PayloadError(gid, "prompt_tokens", "shape", "has 0 samples; accepted: G >= 1.")
  lengths = np.array([len(r) for r in rows], np.int32)
  for i, (r, n) in enumerate(zip(rows, lengths, strict=True)):
    if n == 0:
      raise PayloadError(
        gid, "prompt_tokens", "shape", f"sample {i} is empty; accepted: >= 1 token."
      )
    if n > max_seq_len:
      raise PayloadError(
        gid,
        "prompt_tokens",
        "too_long",
        f"sample {i} has {n} tokens; accepted: at most max_seq_len {max_seq_len}.",
      )
    _check_tokens(gid, "prompt_tokens", r, vocab_size, row_offset=i)
  padded = np.zeros((len(rows), int(lengths.max())), np.int32)
  for i, r in enumerate(rows):
    padded[i, : len(r)] = r
  return padded, lengths


def _check_finite_on_mask(gid, name: str, x: np.ndarray, mask: np.ndarray) -> None:
  _refuse_on_mask(gid, name, x, ~np.isfinite(x) & mask, "non_finite", "finite values")


def _check_logprobs_on_mask(gid, name: str, x: np.ndarray, mask: np.ndarray) -> None:
  # No tolerance: knitjax's sampler clamps its log-probs at 0 (XLA's exp/log can round the
  # argmax token's a few ulps above it), so every log-prob it reports is <= 0. A positive value is
  # a probability, a logit or a sign error, which would skew the IS ratios.
  _refuse_on_mask(gid, name, x, (x > 0) & mask, "value_range", "log-probs <= 0")


def _refuse_on_mask(gid, name: str, x: np.ndarray, bad: np.ndarray, reason: str, accepted: str):
  """Raises for the first ``bad`` position (inside the response mask), naming it."""
  if bad.any():
    i, t = np.argwhere(bad)[0]
    raise PayloadError(
      gid,
      name,
      reason,
      f"is {x[i, t]} at sample {i} position {t} inside response_mask; accepted: {accepted}.",
    )


def _as_input(gid, payload: GroupPayload) -> dict:
  """An input mapping of an already-built payload: ragged prompts cut at ``prompt_lengths``."""
  prompt = _check_array(gid, "prompt_tokens", payload.prompt_tokens, np.int32, (None, None))
  g, p = prompt.shape
  lengths = _check_array(gid, "prompt_lengths", payload.prompt_lengths, np.int32, (g,))
  bad = (lengths < 1) | (lengths > p)
  if bad.any():
    i = int(np.argmax(bad))
    raise PayloadError(
      gid,
      "prompt_lengths",
      "shape",
      f"is {lengths[i]} at sample {i}; accepted: 1 <= length <= {p}.",
    )
  out = {n: x for n, x in payload.to_arrays().items() if n in INPUT_FIELDS}
  out["prompt_tokens"] = [row[:n] for row, n in zip(prompt, lengths, strict=True)]
  return out


def validate_payload(
  group_id,
  payload: Mapping[str, np.ndarray] | GroupPayload,
  num_images: int,
  *,
  vocab_size: int,
  max_seq_len: int,
) -> GroupPayload:
  """Validates a group payload and returns its normalised, read-only stored form.

  Args:
    group_id: the group's id, for messages.
    payload: field name -> array, per the module docstring; or a ``GroupPayload`` (checked the
      same way, its prompts cut at ``prompt_lengths``).
    num_images: how many images come with the group (bounds ``image_index``).
    vocab_size: token ids must lie in ``[0, vocab_size)``.
    max_seq_len: bound on prompt + response tokens per sample.

  Returns:
    The stored form (see the module docstring).

  Raises:
    PayloadError: naming the first bad field and what is accepted.
  """
  if isinstance(payload, GroupPayload):
    payload = _as_input(group_id, payload)
  if not isinstance(payload, Mapping):
    raise PayloadError(
      group_id, "payload", "dtype", "is not a mapping; accepted: a mapping of field -> np.ndarray."
    )
  for name in payload:
    if name not in INPUT_FIELDS:
      raise PayloadError(
        group_id, name, "unknown_field", f"is unknown; accepted: {list(INPUT_FIELDS)}."
      )
  for name in REQUIRED_FIELDS:
    if name not in payload:
      raise PayloadError(
        group_id,
        name,
        "missing_field",
        f"is missing; accepted: payloads with all of {list(REQUIRED_FIELDS)}.",
      )
  if "response_mask" not in payload and "response_lengths" not in payload:
    raise PayloadError(
      group_id,
      "response_mask",
      "missing_field",
      "and response_lengths are both missing; accepted: either or both.",
    )

  prompt, prompt_len = _prompts(group_id, payload["prompt_tokens"], vocab_size, max_seq_len)
  g = len(prompt_len)
  resp = _check_array(group_id, "response_tokens", payload["response_tokens"], np.int32, (g, None))
  n = resp.shape[1]
  if n == 0:
    raise PayloadError(group_id, "response_tokens", "shape", "has width 0; accepted: N >= 1.")
  if n > max_seq_len:
    raise PayloadError(
      group_id,
      "response_tokens",
      "too_long",
      f"has width {n}; accepted: at most max_seq_len {max_seq_len}.",
    )
  _check_tokens(group_id, "response_tokens", resp, vocab_size)

  positions = np.arange(n, dtype=np.int32)
  if "response_lengths" in payload:
    lengths = _check_array(
      group_id, "response_lengths", payload["response_lengths"], np.int32, (g,)
    )
    bad = (lengths < 0) | (lengths > n)
    if bad.any():
      i = int(np.argmax(bad))
      raise PayloadError(
        group_id,
        "response_lengths",
        "shape",
        f"is {lengths[i]} at sample {i}; accepted: 0 <= length <= {n}.",
      )
  if "response_mask" in payload:
    mask = _check_array(group_id, "response_mask", payload["response_mask"], np.bool_, (g, n))
    last = np.where(mask.any(axis=1), n - np.argmax(mask[:, ::-1], axis=1), 0).astype(np.int32)
    if "response_lengths" in payload:
      bad = last > lengths
      if bad.any():
        i = int(np.argmax(bad))
        raise PayloadError(
          group_id,
          "response_mask",
          "shape",
          f"is on at position {last[i] - 1} of sample {i}, past response_lengths {lengths[i]}; "
          "accepted: False from the response length on.",
        )
    else:
      lengths = last
  else:
    mask = positions[None, :] < lengths[:, None]

  total = prompt_len.astype(np.int64) + lengths
  if (total > max_seq_len).any():
    i = int(np.argmax(total > max_seq_len))
    raise PayloadError(
      group_id,
      "response_tokens",
      "too_long",
      f"sample {i} has {prompt_len[i]} prompt + {lengths[i]} response tokens; "
      f"accepted: at most max_seq_len {max_seq_len} in all.",
    )

  out = {
    "prompt_tokens": prompt,
    "prompt_lengths": prompt_len,
    "response_tokens": resp,
    "response_mask": mask,
    "response_lengths": lengths,
  }
  for name in ("logprobs", "ref_logprobs"):
    if name in payload:
      lp = _check_array(group_id, name, payload[name], np.float32, (g, n))
      _check_finite_on_mask(group_id, name, lp, mask)
      _check_logprobs_on_mask(group_id, name, lp, mask)
      out[name] = np.where(mask, lp, np.float32(0.0))
  rewards = _check_array(group_id, "rewards", payload["rewards"], np.float32, (g,))
  if not np.isfinite(rewards).all():
    i = int(np.argmax(~np.isfinite(rewards)))
    raise PayloadError(
      group_id, "rewards", "non_finite", f"is {rewards[i]} at sample {i}; accepted: finite values."
    )
  out["rewards"] = rewards
  if "image_index" in payload:
    idx = _check_array(group_id, "image_index", payload["image_index"], np.int32, (g,))
    bad = (idx < 0) | (idx >= num_images)
    if bad.any():
      i = int(np.argmax(bad))
      raise PayloadError(
        group_id,
        "image_index",
        "shape",
        f"is {idx[i]} at sample {i} but the group has {num_images} images; "
        f"accepted: 0 <= index < {num_images}.",
      )
    out["image_index"] = idx
  for name, x in out.items():
    out[name] = x = np.array(x, copy=True, order="C")
    x.setflags(write=False)
  return GroupPayload(**out)


def validate_image(group_id, k: int, image, *, max_image_bytes: int) -> np.ndarray:
  """Checks image ``k`` of a group and returns a private read-only copy."""
  name = f"images[{k}]"
  if not isinstance(image, np.ndarray):
    raise PayloadError(
      group_id, name, "dtype", f"is a {type(image).__name__}; accepted: np.ndarray."
    )
  if image.dtype not in _IMAGE_DTYPES:
    raise PayloadError(
      group_id, name, "dtype", f"has dtype {image.dtype}; accepted: uint8, float16 or float32."
    )
  if image.ndim not in (2, 3) or image.size == 0:
    raise PayloadError(
      group_id,
      name,
      "shape",
      f"has shape {list(image.shape)}; accepted: non-empty [H, W] or [H, W, C].",
    )
  if image.nbytes > max_image_bytes:
    raise PayloadError(
      group_id,
      name,
      "too_large",
      f"has {image.nbytes} bytes; accepted: at most max_image_bytes {max_image_bytes}.",
    )
  if image.dtype.kind == "f" and not np.isfinite(image).all():
    raise PayloadError(
      group_id, name, "non_finite", "has non-finite pixels; accepted: finite values."
    )
  image = np.array(image, copy=True, order="C")
  image.setflags(write=False)
  return image
