"""Numeric and text extremes for every config field, fed to `knitjax.config.from_config_dict`.

Every scalar field of every section (``model`` and ``vision`` included) meets each extreme of its
type: integers 0, -1 and 10**12; floats 0, -1, 1e12, NaN and +-inf; strings "" and a megabyte of
text. An extreme must be refused in one sentence naming the field, unless `accepted()` lists the
(field, value) with the reason the value is a legitimate setting; every other acceptance counts as
silent. The sweep is exhaustive: one case per (field, extreme), each run once.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import typing
from collections.abc import Callable

from lab.faults.bad_inputs.config_fields import field_names, section_classes
from lab.faults.bad_inputs.core import BadInput, Case, Draw

HUGE_TEXT = "x" * (1 << 20)
INT_EXTREMES = (0, -1, 10**12)
FLOAT_EXTREMES = (0.0, -1.0, 1e12, math.nan, math.inf, -math.inf)
TEXT_EXTREMES = ("", HUGE_TEXT)

_NO_BOUND = "a bound this large never binds: the same as no bound"
_WEIGHT = (
  "a loss weight: that term dominates the loss, finite in float32, the step bounded by the clip"
)
_HUGE = 10**12
_BIG = 1e12

# (section, field) -> {extreme: why accepting it is right}, besides each field's declared off value
# (`knitjax.config_fields.setting`, read by `declared_off`). Anything else must be refused.
LEGAL_EXTREMES: dict[tuple[str, str], dict[object, str]] = {
  ("task", "instruction"): {"": "the question alone, no instruction after it"},
  ("rollout", "temperature"): {_BIG: "near-uniform sampling: a valid policy, log-probs finite"},
  ("optimizer", "b1"): {0.0: "Adam without momentum (RMSProp's update)"},
  ("optimizer", "b2"): {0.0: "Adam with the current gradient's second moment only (sign-like)"},
  ("optimizer", "grad_clip"): {_BIG: _NO_BOUND},
  ("loss", "eps_low"): {0.0: "PPO's clip at ratio 1 below: the strictest legal clip"},
  ("loss", "eps_high"): {
    0.0: "PPO's clip at ratio 1 above: the strictest legal clip",
    _BIG: _NO_BOUND,
  },
  ("loss", "tis_cap"): {_BIG: _NO_BOUND},
  ("loss", "eps_c"): {_BIG: _NO_BOUND},
  ("loss", "kl_coef"): {_BIG: _WEIGHT},
  ("loss", "kl_clamp"): {_BIG: _NO_BOUND},
  ("loss", "entropy_coef"): {
    -1.0: "a negative weight rewards low entropy (sharpening), as some recipes do",
    _BIG: _WEIGHT,
  },
  ("critic", "gamma"): {0.0: "one-step returns: rewards are not carried back"},
  ("critic", "gae_lambda"): {0.0: "TD(0) advantages"},
  ("critic", "value_coef"): {_BIG: _WEIGHT},
  ("critic", "value_clip"): {_BIG: _NO_BOUND},
  ("layout", "logprob_chunk"): {_HUGE: "one chunk: the whole row"},
  ("pipeline", "max_lag_steps"): {_BIG: _NO_BOUND},
  ("pipeline", "locality_slack"): {_BIG: "locality first"},
  ("topology", "actor_restarts"): {
    _HUGE: "actors restarted without limit",
  },
  ("model", "rope_theta"): {_BIG: "a RoPE base: any positive finite value is a valid one"},
  ("model", "norm_eps"): {_BIG: "a finite epsilon: the norm nearly scales by 1/sqrt(eps)"},
  ("model", "lora_rank"): {0: "no LoRA: full fine-tuning"},
  ("model", "lora_alpha"): {_BIG: "a finite adapter scale (B starts at 0)"},
  ("vision", "norm_eps"): {_BIG: "a finite epsilon: the norm nearly scales by 1/sqrt(eps)"},
}


def declared_off() -> dict[tuple[str, str], dict[object, str]]:
  """(section, field) -> {off value: its meaning}, as each section declares it beside the field."""
  from knitjax.config_fields import off_of

  out = {}
  for section, cls in section_classes().items():
    for f in dataclasses.fields(cls):
      if off := off_of(cls, f.name):
        out[(section, f.name)] = {off[0]: f"off: {off[1]}"}
  return out


@functools.cache
def accepted() -> dict[tuple[str, str], dict[object, str]]:
  """Every legal extreme: the declared off values and `LEGAL_EXTREMES`."""
  out = {k: dict(v) for k, v in declared_off().items()}
  for key, values in LEGAL_EXTREMES.items():
    out.setdefault(key, {}).update(values)
  return out


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
  from lab.faults.bad_inputs import configs

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
    legal = accepted().get((section, field), {})
    why = next((w for v, w in legal.items() if _same(v, value)), None)
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
