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


def read_header(file: str) -> dict[str, Entry]:
  """Every tensor's dtype, shape and byte range in ``file``, checked against the file size."""
  size = os.path.getsize(file)
  with open(file, "rb") as f:
    prefix = f.read(8)
    n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
    if not 0 < n <= size - 8:
      raise ValueError(f"{file} is not a safetensors file (bad header length).")
    header = json.loads(f.read(n))
  entries = {}
  for name, spec in header.items():
    if name == "__metadata__":
      continue
    if spec["dtype"] not in DTYPES:
      raise ValueError(
        f"tensor {name!r} in {file} has dtype {spec['dtype']}; accepted: {sorted(DTYPES)}."
      )
    dtype, shape = DTYPES[spec["dtype"]], tuple(spec["shape"])
    begin, end = spec["data_offsets"]
    if end - begin != math.prod(shape) * dtype.itemsize or 8 + n + end > size:
      raise ValueError(f"tensor {name!r} in {file} has data offsets that do not match its shape.")
    entries[name] = Entry(
      file=file, dtype=dtype, shape=shape, start=8 + n + begin, nbytes=end - begin
    )
  return entries


def read_tensor(entry: Entry) -> np.ndarray:
  """Reads exactly one tensor's bytes from disk."""
  raw = np.fromfile(entry.file, dtype=np.uint8, count=entry.nbytes, offset=entry.start)
  return raw.view(entry.dtype).reshape(entry.shape)


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
