"""Packing a mini-batch's variable-length rows into fixed-length sequences (NumPy, host side).

A padded trainer row (:func:`knitjax.train.batch.make_batch`) holds one prompt + response in
``T = P + N`` columns, most of them padding when lengths are long-tailed. Packing moves each
row's real tokens (its contiguous ``valid`` span: the prompt, then the response) into sequences
of ``pack_len`` tokens, several rows per sequence:

* Rule: first-fit decreasing, deterministic. Rows are taken longest first (ties: lower row index
  first); each goes into the first sequence, in creation order, with room for it, else opens a
  new one. A row never splits; a row longer than ``pack_len`` is a ValueError naming both.
* Bucketing (``buckets > 1``): rows are first sorted by length (stable) into ``buckets``
  equal-count groups; each bucket is packed alone and its sequences placed together, so the
  micro-batches cut from consecutive sequences hold rows of similar length.
* Segments: within a sequence the rows are numbered 1, 2, ... in placement order
  (``segment_ids`` int32; 0 = padding) and each row's positions restart at 0, exactly the
  positions of its padded row (``cumsum(valid) - 1``), so RoPE sees the same positions.
* Per-row fields (``advantages``, ``rewards``, ``group_id``) are scattered to the row's tokens,
  giving ``[S, pack_len]`` arrays (0, 0 and -1 on padding); the losses take per-token advantages.
* Count: the number of sequences ``S`` is rounded up to a multiple of ``multiple`` (K
  micro-batches times the batch shards) with empty sequences: all padding (``valid`` False,
  segment 0, no loss). The step is compiled once per distinct ``S``; with ``R`` rows there are at
  most ``ceil(R / multiple)`` of them. ``plan_parts`` gives ``S`` from the row lengths alone
  (it depends only on their multiset), so consumers that each pack their own share of a
  mini-batch can agree on one ``S`` from the groups' metadata, without talking to each other.

Rows with no valid token (none in practice) have no segment; they carry no loss either.

Metrics (:func:`packing_metrics`, written with each mini-batch's step metrics when packing is
on): ``pack_fill`` real tokens / packed positions (``S * pack_len``, the empty sequences included:
the step computes them too), ``pack_padded_fill`` the same for the padded rows it replaces,
``pack_rows`` the packed sequences ``S``, and ``pack_segments_mean`` / ``pack_segments_max`` the
rows per packed sequence (the mean over all ``S``, so ``S * mean`` is the rows packed). When
several consumers each pack their share, :func:`plan_parts` gives the whole mini-batch's from
the packing plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

PACKING_MODES = ("off", "pack")
# [rows, T] arrays copied token by token from a row's valid span.
TOKEN_FIELDS = ("tokens", "positions", "valid", "targets", "loss_mask", "behavior_logp")
# [rows] arrays scattered to every token of the row (padding value after the name).
ROW_FIELDS = (("advantages", 0.0), ("rewards", 0.0), ("group_id", -1))


def first_fit_decreasing(
  lengths: np.ndarray, pack_len: int, *, buckets: int = 1
) -> list[list[int]]:
  """Assigns rows to sequences of ``pack_len`` tokens (the module docstring's rule).

  Args:
    lengths: ``[R]`` tokens per row.
    pack_len: tokens per packed sequence.
    buckets: length buckets packed separately (1: all rows together).

  Returns:
    Per sequence, the row indices in placement order (zero-length rows are left out).

  Raises:
    ValueError: a row is longer than ``pack_len``, or ``pack_len`` / ``buckets`` < 1.
  """
  lengths = np.asarray(lengths, np.int64)
  if pack_len < 1 or buckets < 1:
    raise ValueError(f"pack_len={pack_len} and buckets={buckets} must both be >= 1.")
  if (over := lengths > pack_len).any():
    i = int(np.argmax(over))
    raise ValueError(
      f"row {i} has {lengths[i]} tokens, more than pack_len={pack_len}; raise pack_len to at "
      f"least the longest row ({int(lengths.max())} tokens)."
    )
  by_length = np.argsort(lengths, kind="stable")  # ascending, ties by row index
  sequences: list[list[int]] = []
  for bucket in np.array_split(by_length, min(buckets, max(len(lengths), 1))):
    # Longest first; among equal lengths the lower row index first.
    order = sorted(bucket.tolist(), key=lambda i: (-lengths[i], i))
    free: list[int] = []
    rows: list[list[int]] = []
    for i in order:
      n = int(lengths[i])
      if n == 0:
        continue
      for s, room in enumerate(free):
        if n <= room:
          rows[s].append(i)
          free[s] -= n
          break
      else:
        rows.append([i])
        free.append(pack_len - n)
    sequences.extend(rows)
  return sequences


def sequence_count(needed: int, multiple: int, count: int = 0, *, what: str = "") -> int:
  """``S``: ``needed`` sequences rounded up to a multiple of ``multiple`` (at least one), or
  ``count`` when it is given, checked to be at least that and a multiple.

  Raises:
    ValueError: ``count`` is too small or not a multiple; ``what`` says what needs them (e.g.
      "the rows need {S} packed sequences of 8 tokens").
  """
  rounded = max(multiple, -(-needed // multiple) * multiple)
  if count and (count < rounded or count % multiple):
    raise ValueError(
      f"{what.format(S=rounded)}, but count={count} was asked (at least that many and a "
      f"multiple of {multiple})."
    )
  return count or rounded


def _spans(valid: np.ndarray, loss_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Each row's valid span ``[start, start + length)``; checks that it is contiguous and holds
  every loss position."""
  lengths = valid.sum(axis=1).astype(np.int64)
  start = np.where(lengths > 0, np.argmax(valid, axis=1), 0)
  cols = np.arange(valid.shape[1])[None, :]
  span = (cols >= start[:, None]) & (cols < (start + lengths)[:, None])
  if (bad := (span != valid).any(axis=1)).any():
    i = int(np.argmax(bad))
    raise ValueError(f"row {i}: its valid tokens are not contiguous, so it cannot be packed.")
  if (bad := ((loss_mask != 0) & ~span).any(axis=1)).any():
    i = int(np.argmax(bad))
    raise ValueError(
      f"row {i} carries loss outside its valid tokens (an empty prompt?), so it cannot be packed."
    )
  return start, lengths


def pack_batch(
  batch: Mapping[str, np.ndarray],
  *,
  pack_len: int,
  multiple: int = 1,
  buckets: int = 1,
  count: int = 0,
) -> dict[str, np.ndarray]:
  """Packs the rows of a padded mini-batch into ``[S, pack_len]`` sequences.

  Args:
    batch: :func:`~knitjax.train.batch.make_batch` arrays (``[R, T]`` token fields and ``[R]``
      ``advantages``, ``rewards``, ``group_id``; ``advantages`` may also be ``[R, T]``).
    pack_len: tokens per packed sequence.
    multiple: ``S`` is rounded up to a multiple of this (micro-batches times batch shards).
    buckets: length buckets packed separately (see the module docstring).
    count: ``S`` exactly (a multiple of ``multiple``, e.g. agreed between consumers with
      :func:`plan_parts`); 0: as few as the rows need.

  Returns:
    ``TOKEN_FIELDS`` and the ``ROW_FIELDS`` as ``[S, pack_len]`` arrays (dtypes kept) plus
    ``segment_ids`` int32 ``[S, pack_len]`` (1, 2, ... per row of a sequence; 0 on padding).

  Raises:
    ValueError: a row does not fit ``pack_len``, or cannot be packed (see ``_spans``), or the
      rows need more than ``count`` sequences.
  """
  if multiple < 1:
    raise ValueError(f"multiple={multiple} must be >= 1.")
  valid = np.asarray(batch["valid"], bool)
  start, lengths = _spans(valid, np.asarray(batch["loss_mask"]))
  sequences = first_fit_decreasing(lengths, pack_len, buckets=buckets)
  count = sequence_count(
    len(sequences), multiple, count,
    what=f"the rows need {{S}} packed sequences of {pack_len} tokens",
  )  # fmt: skip

  # Source (row, column) and destination (sequence, column) of every kept token, vectorised.
  rows = np.array([i for seq in sequences for i in seq], np.int64)
  seq_of = np.array([s for s, seq in enumerate(sequences) for _ in seq], np.int64)
  seg_of = np.array([j + 1 for seq in sequences for j in range(len(seq))], np.int32)
  offset = np.zeros(len(rows), np.int64)  # where each row starts in its sequence
  for s, seq in enumerate(sequences):
    ends = np.cumsum(lengths[seq])
    offset[seq_of == s] = ends - lengths[seq]
  n = lengths[rows]
  token_row = np.repeat(np.arange(len(rows)), n)  # index into `rows` of each kept token
  within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
  src_r, src_c = rows[token_row], start[rows][token_row] + within
  dst_s, dst_c = seq_of[token_row], offset[token_row] + within

  out = {}
  for name in TOKEN_FIELDS:
    x = np.asarray(batch[name])
    packed = np.zeros((count, pack_len), x.dtype)
    packed[dst_s, dst_c] = x[src_r, src_c]
    out[name] = packed
  # Positions restart at 0 per row: its padded positions already do (cumsum(valid) - 1).
  for name, pad in ROW_FIELDS:
    x = np.asarray(batch[name])
    packed = np.full((count, pack_len), pad, x.dtype)
    packed[dst_s, dst_c] = x[src_r, src_c] if x.ndim == 2 else x[src_r]
    out[name] = packed
  segment_ids = np.zeros((count, pack_len), np.int32)
  segment_ids[dst_s, dst_c] = seg_of[token_row]
  out["segment_ids"] = segment_ids
  return out


def packing_metrics(
  batch: Mapping[str, np.ndarray], packed: Mapping[str, np.ndarray]
) -> dict[str, float]:
  """The module docstring's metrics of one mini-batch: its padded ``batch`` and what
  :func:`pack_batch` made of it (host NumPy, ``O(S * pack_len)``)."""
  segments = np.asarray(packed["segment_ids"]).max(axis=1, initial=0)  # ids run 1..n per row
  useful = float(np.count_nonzero(batch["valid"]))
  return {
    "pack_fill": useful / max(packed["segment_ids"].size, 1),
    "pack_padded_fill": useful / max(np.asarray(batch["valid"]).size, 1),
    "pack_rows": float(len(segments)),
    "pack_segments_mean": float(segments.mean()) if len(segments) else 0.0,
    "pack_segments_max": float(segments.max(initial=0)),
  }


def plan_parts(
  lengths: Sequence[Sequence[int]],
  *,
  pack_len: int,
  multiple: int = 1,
  buckets: int = 1,
  row_len: int,
) -> tuple[int, dict[str, float]]:
  """A mini-batch whose rows are packed in parts (one per consumer), each part alone into the
  same number of sequences, from the row lengths alone (``lengths[c]``: tokens per row of part
  ``c``; ``row_len``: the padded row length).

  Returns:
    ``S``, the sequences each part lays out (the most any part needs, rounded up to
    ``multiple``), and the :func:`packing_metrics` the parts' packed arrays together give.
  """
  plans = [
    first_fit_decreasing(np.asarray(part, np.int64), pack_len, buckets=buckets) for part in lengths
  ]
  count = sequence_count(max((len(p) for p in plans), default=0), multiple)
  segments = np.array([len(s) for p in plans for s in p] + [0] * sum(count - len(p) for p in plans))
  useful = float(sum(np.sum(part) for part in lengths))
  return count, {
    "pack_fill": useful / max(len(segments) * pack_len, 1),
    "pack_padded_fill": useful / max(sum(len(part) for part in lengths) * row_len, 1),
    "pack_rows": float(len(segments)),
    "pack_segments_mean": float(segments.mean()) if len(segments) else 0.0,
    "pack_segments_max": float(segments.max(initial=0)),
  }


@dataclasses.dataclass(frozen=True)
class PackSpec:
  """How a trainer packs each mini-batch: ``spec(batch)`` is :func:`pack_batch` with these.

  Attributes:
    pack_len: tokens per packed sequence.
    multiple: the sequence count is rounded up to a multiple of this (micro-batches times the
      train mesh's batch shards).
    buckets: length buckets packed separately.
  """

  pack_len: int
  multiple: int
  buckets: int = 1

  def __call__(self, batch: Mapping[str, np.ndarray], *, count: int = 0) -> dict[str, np.ndarray]:
    return pack_batch(
      batch, pack_len=self.pack_len, multiple=self.multiple, buckets=self.buckets, count=count
    )

  def with_metrics(
    self, batch: Mapping[str, np.ndarray], *, count: int = 0
  ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The packed batch (``count``: see :func:`pack_batch`) and its :func:`packing_metrics`."""
    packed = self(batch, count=count)
    return packed, packing_metrics(batch, packed)

  def plan_parts(
    self, lengths: Sequence[Sequence[int]], *, row_len: int
  ) -> tuple[int, dict[str, float]]:
    """:func:`plan_parts` with these settings."""
    return plan_parts(
      lengths, pack_len=self.pack_len, multiple=self.multiple, buckets=self.buckets,
      row_len=row_len,
    )  # fmt: skip
