"""The group payload: one frozen type from rollout to the trainer batch.

:class:`GroupPayload` is a group's payload in its normalised stored form: ``prompt_tokens``
right-padded with 0 to ``[G, P_max]`` plus ``prompt_lengths`` ``[G]``; ``response_tokens``
``[G, N]`` with both ``response_mask`` (the tokens that carry loss; it may have holes inside the
response, e.g. tool output in a multi-turn episode) and ``response_lengths``; ``logprobs`` 0.0
where the mask is off; ``rewards`` ``[G]``; optional ``ref_logprobs`` and ``image_index``. Its
dataclass fields are the one list of payload fields. Rollout builds it, the storage unit
validates it once (`knitjax.transfer.validation`, which also accepts a plain mapping of input
arrays), consumers get it back, :func:`stack_rows` lays several groups out as ``[rows, ...]``
arrays for a trainer batch, and ``to_arrays``/``from_arrays`` is its one serialisation.
"""

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np


def _array(dtype, role: str):
  """A ``GroupPayload`` field: its stored dtype and its role in an input payload.

  Roles: ``required``; ``mask_or_lengths`` (at least one of the two is given); ``optional``;
  ``derived`` (computed by validation, not accepted as input).
  """
  metadata = {"dtype": np.dtype(dtype), "role": role}
  if role == "optional":
    return dataclasses.field(default=None, metadata=metadata)
  return dataclasses.field(metadata=metadata)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class GroupPayload:
  """A group's payload in its normalised stored form (see the module docstring).

  Built by :func:`validate_payload` (the one place a payload is checked, where it enters a storage
  unit) or :meth:`from_arrays`; the constructor itself checks nothing. The dataclass fields are
  the one list of payload fields: names, dtypes and input roles all derive from them.

  Attributes:
    prompt_tokens: int32 ``[G, P]``, right-padded with 0.
    prompt_lengths: int32 ``[G]``, tokens of each prompt (``>= 1``).
    response_tokens: int32 ``[G, N]``, right-padded.
    response_mask: bool ``[G, N]``, the tokens that carry loss (may have holes, e.g. tool output).
    response_lengths: int32 ``[G]``, tokens of each response (the mask is off from there on).
    logprobs: float32 ``[G, N]``, behavior log-probs, 0 off the mask.
    rewards: float32 ``[G]``.
    ref_logprobs: float32 ``[G, N]``, 0 off the mask, or None.
    image_index: int32 ``[G]``, each sample's index into the group's images, or None.
  """

  prompt_tokens: np.ndarray = _array(np.int32, "required")
  prompt_lengths: np.ndarray = _array(np.int32, "derived")
  response_tokens: np.ndarray = _array(np.int32, "required")
  response_mask: np.ndarray = _array(np.bool_, "mask_or_lengths")
  response_lengths: np.ndarray = _array(np.int32, "mask_or_lengths")
  logprobs: np.ndarray = _array(np.float32, "required")
  rewards: np.ndarray = _array(np.float32, "required")
  ref_logprobs: np.ndarray | None = _array(np.float32, "optional")
  image_index: np.ndarray | None = _array(np.int32, "optional")

  @property
  def num_samples(self) -> int:
    """``G``, the number of samples (rows) of the group."""
    return len(self.rewards)

  @property
  def nbytes(self) -> int:
    """Bytes of the arrays held (the optional fields only when present)."""
    return sum(x.nbytes for x in self.to_arrays().values())

  def to_arrays(self) -> dict[str, np.ndarray]:
    """Field name -> array, the optional fields only when present (checkpoints, ``np.savez``)."""
    return {name: x for name in FIELD_DTYPES if (x := getattr(self, name)) is not None}

  @classmethod
  def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> "GroupPayload":
    """Inverse of :meth:`to_arrays`; checks the field names only (storage validates the rest).

    Raises:
      ValueError: a field is unknown, or a non-optional one is missing.
    """
    unknown = sorted(set(arrays) - set(FIELD_DTYPES))
    if unknown:
      raise ValueError(f"unknown payload fields {unknown}; accepted: {list(FIELD_DTYPES)}.")
    missing = [n for n in FIELD_DTYPES if n not in arrays and n not in OPTIONAL_FIELDS]
    if missing:
      raise ValueError(
        f"payload fields {missing} are missing; only {list(OPTIONAL_FIELDS)} may be."
      )
    return cls(**{name: np.asarray(x) for name, x in arrays.items()})


_FIELDS = dataclasses.fields(GroupPayload)
# Dtypes of the stored form, by field name (every field of GroupPayload, in its order).
FIELD_DTYPES = {f.name: f.metadata["dtype"] for f in _FIELDS}
# Fields an input payload may carry (all but the derived prompt lengths).
INPUT_FIELDS = tuple(f.name for f in _FIELDS if f.metadata["role"] != "derived")
REQUIRED_FIELDS = tuple(f.name for f in _FIELDS if f.metadata["role"] == "required")
OPTIONAL_FIELDS = tuple(f.name for f in _FIELDS if f.metadata["role"] == "optional")


def stack_rows(payloads: Sequence[GroupPayload]) -> dict[str, np.ndarray]:
  """The groups' samples as ``[rows, ...]`` arrays, groups in the given order.

  Token-width fields are padded (0, False) to the widest group: prompts stay right-padded with
  ``prompt_lengths``, responses with ``response_mask`` and ``response_lengths``. An optional field
  appears only when every group has it.

  Raises:
    ValueError: ``payloads`` is empty.
  """
  if not payloads:
    raise ValueError("stack_rows got no group payloads; accepted: at least one.")
  rows = sum(p.num_samples for p in payloads)
  out = {}
  for name, dtype in FIELD_DTYPES.items():
    parts = [getattr(p, name) for p in payloads]
    if any(x is None for x in parts):
      continue
    widths = tuple(max(x.shape[d] for x in parts) for d in range(1, parts[0].ndim))
    stacked = np.zeros((rows, *widths), dtype)
    r = 0
    for x in parts:  # one slice copy per group; padding stays 0 / False
      stacked[(slice(r, r + len(x)), *(slice(0, d) for d in x.shape[1:]))] = x
      r += len(x)
    out[name] = stacked
  return out


def synthetic_payload(
  rng: np.random.Generator,
  *,
  group_size: int,
  prompt_len: int,
  response_len: int,
  vocab_size: int,
  min_response: int = 1,
) -> dict[str, np.ndarray]:
  """A valid random payload of one group (benchmarks and tests; no model involved).

  Responses have uniform lengths in ``[min_response, response_len]``; log-probs are negative on
  the response mask and 0 off it; rewards are 0/1.
  """
  lens = rng.integers(min_response, response_len + 1, group_size).astype(np.int32)
  mask = np.arange(response_len)[None] < lens[:, None]
  return {
    "prompt_tokens": rng.integers(3, vocab_size, (group_size, prompt_len)).astype(np.int32),
    "response_tokens": rng.integers(3, vocab_size, (group_size, response_len)).astype(np.int32),
    "response_mask": mask,
    "response_lengths": lens,
    "logprobs": np.where(mask, np.minimum(rng.normal(-3, 0.5, mask.shape), 0), 0).astype(
      np.float32
    ),
    "rewards": rng.integers(0, 2, group_size).astype(np.float32),
  }
