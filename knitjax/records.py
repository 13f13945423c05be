"""Frozen dataclass records <-> JSON-able dicts: the one serialisation of host records.

Checkpoints store host metadata as JSON (orbax ``JsonSave``): group metadata, released
mini-batches, prompts of groups still generating, the run state. Every such record is a frozen
dataclass, and this module is the single codec for them, driven by the dataclass fields and their
type hints: nested records, ``tuple[Record, ...]``, tuples of scalars and NumPy arrays (as
``{"__ndarray__": dtype, "shape": [...], "data": base64}``). Ray pickles the records themselves.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any

import numpy as np

_ARRAY = "__ndarray__"


def to_json(value: Any) -> Any:
  """A JSON-able form of a record (or of a list, dict, tuple, array or scalar inside one)."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, np.ndarray):
    a = np.ascontiguousarray(value)
    return {_ARRAY: a.dtype.str, "shape": list(a.shape), "data": base64.b64encode(a).decode()}
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, list | tuple):
    return [to_json(v) for v in value]
  if isinstance(value, Mapping):
    return {str(k): to_json(v) for k, v in value.items()}
  return value


def from_json(cls: type, data: Any) -> Any:
  """Inverse of :func:`to_json` for a record of type ``cls``.

  Raises:
    ValueError: ``data`` lacks a field of ``cls``, has one it does not know, or holds a value
      that does not decode (one sentence naming the field).
  """
  if not isinstance(data, Mapping):
    raise ValueError(f"a {cls.__name__} record must be a mapping, got {type(data).__name__}.")
  hints = _hints(cls)
  fields = [f for f in dataclasses.fields(cls) if f.init]
  names = {f.name for f in fields}
  unknown = sorted(set(data) - names)
  if unknown:
    raise ValueError(
      f"a {cls.__name__} record has unknown fields {unknown}; known: {sorted(names)}."
    )
  required = dataclasses.MISSING
  missing = [
    f.name
    for f in fields
    if f.name not in data and f.default is required and f.default_factory is required
  ]
  if missing:
    raise ValueError(f"a {cls.__name__} record lacks the fields {missing}.")
  values = {}
  for k, v in data.items():
    try:
      values[k] = _decode(hints[k], v)
    except ValueError:
      raise
    except (TypeError, KeyError, AttributeError, IndexError) as e:
      raise ValueError(
        f"a {cls.__name__} record's field {k!r}={v!r:.80} does not decode ({e})."
      ) from None
  try:
    return cls(**values)
  except TypeError as e:  # a value of the wrong kind met the record's own checks
    raise ValueError(f"a {cls.__name__} record does not build: {e}.") from None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _decode(hint: Any, value: Any) -> Any:
  if isinstance(value, Mapping) and _ARRAY in value:
    raw = base64.b64decode(value["data"])
    return np.frombuffer(raw, np.dtype(value[_ARRAY])).reshape(value["shape"]).copy()
  if value is None:
    return None
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    inner = [a for a in args if a is not type(None)]
    return _decode(inner[0], value) if len(inner) == 1 else value
  if dataclasses.is_dataclass(hint):
    return from_json(hint, value)
  if origin is tuple:
    item = args[0] if args else Any
    return tuple(_decode(item, v) for v in value)
  if origin is list or isinstance(value, list):
    return [_decode(args[0] if origin is list and args else Any, v) for v in value]
  if isinstance(value, Mapping):  # a plain dict: arrays inside it are decoded too
    return {k: _decode(Any, v) for k, v in value.items()}
  return value
