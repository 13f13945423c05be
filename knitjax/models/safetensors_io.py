"""The safetensors file format, read and written with NumPy (``ml_dtypes`` for bf16).

A file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, data
offsets) and the raw little-endian bytes. Tensors are read one at a time at their offsets and
written streamed, one at a time, so a checkpoint never sits in host memory twice. Like every JAX
host, the host is assumed little-endian. Checked against files written by ``transformers``
(tests/models/data).
"""

import dataclasses
import json
import math
import os
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
  file: str
  dtype: np.dtype
  shape: tuple[int, ...]
  start: int  # absolute byte offset in `file`
  nbytes: int
  name: str = ""  # the tensor's name in the header, for messages


_MAX_HEADER_BYTES = 100_000_000  # the reference reader's limit
_FIELDS = ("dtype", "shape", "data_offsets")
# Header values are shown as `{value!r:.60}`: a junk header must not flood an error message.


def _is_count(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(file: str, name: str, spec, data_start: int, data_size: int) -> Entry:
  """One header entry, checked; every problem is one ValueError naming the file and tensor."""
  where = f"tensor {name!r} in {file}"
  missing = [key for key in _FIELDS if key not in spec] if isinstance(spec, dict) else _FIELDS
  if missing:
    what = f"lacks {missing[0]}" if isinstance(spec, dict) else f"is {spec!r:.60}"
    raise ValueError(f"{where} {what}; accepted: an object with dtype, shape and data_offsets.")
  dtype, shape, offsets = (spec[key] for key in _FIELDS)
  if not isinstance(dtype, str) or dtype not in DTYPES:
    raise ValueError(f"{where} has dtype {dtype!r:.60}; accepted: {sorted(DTYPES)}.")
  if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
    raise ValueError(f"{where} has shape {shape!r:.60}; accepted: a list of integers >= 0.")
  if (
    not isinstance(offsets, list)
    or len(offsets) != 2
    or not all(_is_count(o) for o in offsets)
    or offsets[0] > offsets[1]
  ):
    raise ValueError(
      f"{where} has data_offsets {offsets!r:.60}; accepted: [begin, end] with 0 <= begin <= end."
    )
  (begin, end), nbytes = offsets, math.prod(shape) * DTYPES[dtype].itemsize
  if end - begin != nbytes:
    raise ValueError(
      f"{where} has data_offsets {offsets} ({end - begin} bytes) but {dtype}{shape} needs {nbytes}."
    )
  if end > data_size:
    raise ValueError(
      f"{where} has data_offsets {offsets} but the file holds only {data_size} bytes of data "
      "(truncated?)."
    )
  return Entry(
    file=file,
    dtype=DTYPES[dtype],
    shape=tuple(shape),
    start=data_start + begin,
    nbytes=nbytes,
    name=name,
  )


def _check_overlaps(file: str, entries: dict[str, Entry]) -> None:
  """Refuses two tensors whose bytes overlap (empty tensors take no bytes)."""
  spans = sorted((e.start, e.start + e.nbytes, name) for name, e in entries.items() if e.nbytes)
  for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
    if start < end:
      raise ValueError(
        f"tensors {first!r} and {second!r} in {file} have overlapping data_offsets; accepted: "
        "each tensor's bytes its own."
      )


def read_header(file: str) -> dict[str, Entry]:
  """Every tensor's dtype, shape and byte range in ``file``, checked against the file size.

  Raises:
    ValueError: one sentence naming the file (and the tensor) for a missing or unreadable file, a
      bad header length, a header that is not a JSON object, an entry whose dtype, shape or
      data offsets are malformed, disagree, or point past the end of the file, or two tensors
      whose data offsets overlap.
  """
  try:
    size = os.path.getsize(file)
    with open(file, "rb") as f:
      prefix = f.read(8)
      if len(prefix) < 8:
        raise ValueError(f"{file} has {size} bytes, too few to be a safetensors file.")
      n, limit = struct.unpack("<Q", prefix)[0], min(size - 8, _MAX_HEADER_BYTES)
      if not 0 < n <= limit:
        raise ValueError(
          f"{file} is not a safetensors file: its header length is {n}; accepted: 1 to {limit} "
          f"for a file of {size} bytes."
        )
      raw = f.read(n)
  except FileNotFoundError:
    raise ValueError(f"{file} does not exist.") from None
  except OSError as e:
    raise ValueError(f"{file} cannot be read ({e.strerror or type(e).__name__}).") from None
  try:
    header = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ValueError(
      f"{file} is not a safetensors file: its header is not UTF-8 JSON ({reason})."
    ) from None
  if not isinstance(header, dict):
    raise ValueError(
      f"{file} is not a safetensors file: its header is {json.dumps(header):.60}, not an object."
    )
  data_start = 8 + n
  entries = {
    name: _entry(file, name, spec, data_start, size - data_start)
    for name, spec in header.items()
    if name != "__metadata__"
  }
  _check_overlaps(file, entries)
  return entries


def read_tensor(entry: Entry) -> np.ndarray:
  """Reads exactly one tensor's bytes from disk; NaN or inf in it is a damaged checkpoint.

  Raises:
    ValueError: one sentence naming the file and the tensor, when a value is not finite (else a
      NaN weight would surface later as a bad log-prob payload, far from its cause).
  """
  raw = np.fromfile(entry.file, dtype=np.uint8, count=entry.nbytes, offset=entry.start)
  array = raw.view(entry.dtype).reshape(entry.shape)
  if not np.isfinite(array).all():
    bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
    raise ValueError(
      f"tensor {entry.name!r} in {entry.file} holds {bad:,} non-finite values (NaN or inf); the "
      "checkpoint is damaged."
    )
  return array


def write_streamed(file: str, items: list[tuple[str, tuple[int, ...], np.dtype, object]]) -> None:
  """Writes `(name, shape, dtype, fetch)` items; `fetch()` is called for one tensor at a time."""
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, shape, dtype, _ in items:
    if np.dtype(dtype) not in DTYPE_NAMES:
      raise ValueError(f"tensor {name!r} has dtype {dtype}; accepted: {sorted(DTYPE_NAMES)}.")
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    header[name] = {
      "dtype": DTYPE_NAMES[np.dtype(dtype)],
      "shape": list(shape),
      "data_offsets": [offset, offset + nbytes],
    }
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the reference writer aligns the data to 8 bytes
  with open(file, "wb") as f:
    f.write(struct.pack("<Q", len(blob)) + blob)
    for name, shape, dtype, fetch in items:
      array = np.asarray(fetch())
      if array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
        raise ValueError(f"tensor {name!r} is not {dtype}{list(shape)} as its header says.")
      f.write(np.ascontiguousarray(array).view(np.uint8).data)


def write_safetensors(file: str | os.PathLike, tensors: Mapping[str, np.ndarray]) -> None:
  """Writes one `.safetensors` file (F64/F32/F16/BF16 tensors) in the stored order."""
  items = [(n, tuple(np.shape(a)), np.asarray(a).dtype, lambda a=a: a) for n, a in tensors.items()]
  write_streamed(os.fspath(file), items)
