"""Numeric and text extremes for every config field, fed to `knitjax.config.from_config_dict`.

Every scalar field of every section (``model`` and ``vision`` included) meets each extreme of its
type: integers 0, -1 and 10**12; floats 0, -1, 1e12, NaN and +-inf; strings "" and a megabyte of
text. An extreme must be refused in one sentence naming the field, unless `ACCEPTED` lists the
(field, value) with the reason the value is a legitimate setting; every other acceptance counts as
silent. The sweep is exhaustive: one case per (field, extreme), each run once.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from collections.abc import Callable

from knitjax.faults.bad_inputs.config_fields import field_names, section_classes
from knitjax.faults.bad_inputs.core import BadInput, Case, Draw

HUGE_TEXT = "x" * (1 << 20)
INT_EXTREMES = (0, -1, 10**12)
FLOAT_EXTREMES = (0.0, -1.0, 1e12, math.nan, math.inf, -math.inf)
TEXT_EXTREMES = ("", HUGE_TEXT)

# (section, field) -> {extreme: why accepting it is right}. Anything not here must be refused.
ACCEPTED: dict[tuple[str, str], dict[object, str]] = {}


def extremes(annotation) -> tuple:
  """The extremes a field of this type meets (none for bools, tuples, mappings, sections)."""
  if annotation is int:
    return INT_EXTREMES
  if annotation is float:
    return FLOAT_EXTREMES
  if annotation is str:
    return TEXT_EXTREMES
  args = [a for a in typing.get_args(annotation) if a is not type(None)]
  if len(args) == 1 and args[0] in (int, float, str):  # an optional scalar
    return extremes(args[0])
  return ()


def _fields() -> list[tuple[str, str, tuple]]:
  out = []
  for section, cls in section_classes().items():
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      values = extremes(hints[f.name]) if f.init else ()
      if values:
        out.append((section, f.name, values))
  return out


def context(folder: str) -> dict:
  from knitjax.faults.bad_inputs import configs

  return configs.context(folder)


def _base_with(ctx: dict, section: str) -> tuple[str, dict]:
  """The first shipped quick config that has ``section`` (``vision``: the VLM config)."""
  for name in sorted(ctx["bases"]):
    if isinstance(ctx["bases"][name].get(section), dict) or section not in ("model", "vision"):
      return name, copy.deepcopy(ctx["bases"][name])
  raise ValueError(f"no shipped config has a {section} section.")


def _case(section: str, field: str, value) -> Callable[[Draw, dict], BadInput]:
  def make(draw: Draw, ctx: dict) -> BadInput:
    from knitjax.config import from_config_dict

    name, d = _base_with(ctx, section)
    d.setdefault(section, {})[field] = value
    shown = f"{value[:20]!r}... ({len(value)} chars)" if isinstance(value, str) else repr(value)
    why = next((w for v, w in ACCEPTED.get((section, field), {}).items() if _same(v, value)), None)
    return BadInput(
      f"{name}: {section}.{field}={shown}",
      field_names(section, field),
      lambda: from_config_dict(d),
      may_accept=why,
    )

  return make


def _same(a, b) -> bool:
  both_nan = isinstance(a, float) and math.isnan(a) and math.isnan(b)
  return type(a) is type(b) and (a == b or both_nan)


def _label(value) -> str:
  return f"<{len(value)} chars>" if isinstance(value, str) else repr(value)


def cases() -> list[Case]:
  return [(f"{s}.{f}={_label(v)}", _case(s, f, v)) for s, f, values in _fields() for v in values]
