"""How a config section is built and checked.

:func:`build_section` turns a mapping (a ConfigDict section or a plain dict) into a frozen,
keyword-only dataclass: it rejects unknown keys and missing required fields, checks each value
against its field's type (mapping value types included), and accepts only finite floats. Every
error is one sentence naming the field and what is accepted. :func:`one_of` and
:func:`positive` are the small checks the sections' ``__post_init__`` run.

A field whose value can switch its feature off declares that value once, beside the field, with
:func:`setting` (``tis_cap: float = setting(0.0, off=0.0, meaning="no truncated IS")``);
:func:`off_of` reads it back for the errors, the docs (docs/config.md) and the lab's extremes
sweep.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

_OFF = "knitjax.off"  # dataclass field metadata: (off value, what it means)


def setting(default: Any, *, off: Any, meaning: str) -> Any:
  """A section field whose value ``off`` turns its feature off (``meaning`` says how)."""
  return dataclasses.field(default=default, metadata={_OFF: (off, meaning)})


def off_of(cls: type, name: str) -> tuple[Any, str] | None:
  """``(off value, meaning)`` of field ``name`` of section ``cls``, or None if it has none."""
  field = {f.name: f for f in dataclasses.fields(cls)}[name]
  return field.metadata.get(_OFF)


def off_note(cls: type, name: str) -> str:
  """`` (0: no truncated IS)`` for a field that declares an off value, else ``""``."""
  off = off_of(cls, name)
  return f" ({off[0]!r}: {off[1]})" if off else ""


def one_of(path: str, value: Any, allowed: tuple[str, ...]) -> None:
  """Raises a ValueError naming ``path`` unless ``value`` is one of ``allowed``."""
  if value not in allowed:
    raise ValueError(f"{path}={value!r} is not accepted; choose one of: {', '.join(allowed)}.")


# Upper bounds on counts: far above any real run, far below what hangs or exhausts memory before a
# check could speak (a group of 10**12 samples, 100,000 fake devices).
MAX_TOKENS = 1 << 20  # tokens per sequence (prompt, response, chunk): 1M, the longest context
MAX_SAMPLES = 1 << 20  # samples or prompts at once (group size, slots, batches)
MAX_STEPS = (1 << 31) - 1  # steps and versions are int32 in the jitted steps (fold_in of the step)
MAX_CPU_DEVICES = 1024  # fake CPU devices: JAX starts each one, 100,000 take minutes
MAX_DEVICES = 1 << 16  # devices of one mesh: above the largest TPU slices
MAX_TEXT = 1 << 16  # characters of a config string (a path, an address, a system prompt)


def positive(
  path: str,
  value: float,
  *,
  allow_zero: bool = False,
  at_most: int | None = None,
  section: type | None = None,
) -> None:
  """Raises a ValueError naming ``path`` unless ``value`` > 0 (>= 0 with ``allow_zero``) and, with
  ``at_most``, ``value <= at_most``. With ``section`` (the field's dataclass), the error also
  says what the field's declared off value means."""
  if value < 0 or (value == 0 and not allow_zero):
    bound = ">= 0" if allow_zero else "> 0"
    note = off_note(section, path.rsplit(".", 1)[1]) if section is not None else ""
    raise ValueError(f"{path}={value!r} is not accepted; it must be {bound}{note}.")
  if at_most is not None and value > at_most:
    raise ValueError(f"{path}={value!r} is not accepted; it must be at most {at_most:,}.")


def to_plain(x: Any) -> Any:
  """A ConfigDict as a plain dict; anything else unchanged."""
  if hasattr(x, "to_dict"):
    return x.to_dict()
  return x


def _type_ok(value: Any, annotation: Any) -> bool:
  """Checks a config value against a (simple) dataclass field annotation."""
  origin = typing.get_origin(annotation)
  if annotation is Any:
    return True
  if origin in (typing.Union, types.UnionType):
    return any(_type_ok(value, a) for a in typing.get_args(annotation))
  if annotation is type(None):
    return value is None
  if annotation is float:
    return isinstance(value, int | float) and not isinstance(value, bool)
  if annotation is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if annotation in (bool, str):
    return isinstance(value, annotation)
  if origin is tuple:
    return isinstance(value, tuple | list)
  if origin is Mapping or annotation is Mapping:
    if not isinstance(value, Mapping):
      return False
    args = typing.get_args(annotation)
    return not args or all(_type_ok(k, args[0]) and _type_ok(v, args[1]) for k, v in value.items())
  return True


def _type_name(annotation: Any) -> str:
  if typing.get_origin(annotation) is Mapping:
    k, v = (_type_name(a) for a in typing.get_args(annotation))
    return f"a mapping of {k} to {v}"
  return getattr(annotation, "__name__", str(annotation))


def build_section(cls: type, values: Mapping[str, Any], path: str) -> Any:
  """Builds a frozen dataclass from a mapping, naming unknown keys and wrong types."""
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls) if f.init}
  values = to_plain(values)
  if not isinstance(values, Mapping):
    raise ValueError(
      f"{path}={values!r:.80} is not accepted; it must be a mapping of field names to values."
    )
  required = [
    f.name
    for f in dataclasses.fields(cls)
    if f.init
    and f.default is dataclasses.MISSING
    and f.default_factory is dataclasses.MISSING
    and f.name not in values
  ]
  if required:
    raise ValueError(f"{path}.{required[0]} is missing; it has no default.")
  kwargs = {}
  for key, value in values.items():
    if key not in fields:
      raise ValueError(
        f"{path}.{key} is not a known field; known fields: {', '.join(sorted(fields))}."
      )
    value = to_plain(value)
    if not _type_ok(value, hints[key]):
      raise ValueError(
        f"{path}.{key}={value!r} has the wrong type; expected {_type_name(hints[key])}."
      )
    if isinstance(value, float) and not math.isfinite(value):
      raise ValueError(f"{path}.{key}={value!r} is not accepted; it must be a finite number.")
    if isinstance(value, str) and len(value) > MAX_TEXT:
      raise ValueError(
        f"{path}.{key} is {len(value):,} characters long; at most {MAX_TEXT:,} are accepted."
      )
    if isinstance(value, list):
      value = tuple(value)
    kwargs[key] = value
  return cls(**kwargs)
