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

from lab.faults.bad_inputs.config_fields import field_names, section_classes
from lab.faults.bad_inputs.core import BadInput, Case, Draw

HUGE_TEXT = "x" * (1 << 20)
INT_EXTREMES = (0, -1, 10**12)
FLOAT_EXTREMES = (0.0, -1.0, 1e12, math.nan, math.inf, -math.inf)
TEXT_EXTREMES = ("", HUGE_TEXT)

_OFF = "0 turns it off"
_NO_BOUND = "a bound this large never binds: the same as no bound"
_WEIGHT = (
  "a loss weight: that term dominates the loss, finite in float32, the step bounded by the clip"
)
_HUGE = 10**12
_BIG = 1e12

# (section, field) -> {extreme: why accepting it is right}. Anything not here must be refused.
ACCEPTED: dict[tuple[str, str], dict[object, str]] = {
  ("task", "path"): {"": "no file: generated tasks read none, file tasks refuse it"},
  ("task", "prompt_len"): {0: "the task's own longest prompt"},
  ("task", "system_prompt"): {"": "no system message"},
  ("task", "instruction"): {"": "the question alone, no instruction after it"},
  ("rollout", "temperature"): {_BIG: "near-uniform sampling: a valid policy, log-probs finite"},
  ("rollout", "top_k"): {0: "off: the whole vocabulary"},
  ("rollout", "prefill_chunk"): {0: "the whole prompt in one prefill"},
  ("rollout", "overlong_buffer"): {0: _OFF},
  ("rollout", "turn_tokens"): {0: "each turn may use rollout.max_new_tokens"},
  ("train", "warmup_steps"): {0: "no warmup"},
  ("train", "weight_decay"): {0.0: "no decay"},
  ("train", "b1"): {0.0: "Adam without momentum (RMSProp's update)"},
  ("train", "b2"): {0.0: "Adam with the current gradient's second moment only (sign-like steps)"},
  ("train", "grad_clip"): {0.0: _OFF, _BIG: _NO_BOUND},
  ("train", "eps_low"): {0.0: "PPO's clip at ratio 1 below: the strictest legal clip"},
  ("train", "eps_high"): {
    0.0: "PPO's clip at ratio 1 above: the strictest legal clip",
    _BIG: _NO_BOUND,
  },
  ("train", "tis_cap"): {0.0: _OFF, _BIG: _NO_BOUND},
  ("train", "eps_c"): {0.0: _OFF, _BIG: _NO_BOUND},
  ("train", "kl_coef"): {0.0: "no KL term", _BIG: _WEIGHT},
  ("train", "kl_clamp"): {0.0: _OFF, _BIG: _NO_BOUND},
  ("train", "entropy_coef"): {
    0.0: "no entropy term",
    -1.0: "a negative weight rewards low entropy (sharpening), as some recipes do",
    _BIG: _WEIGHT,
  },
  ("train", "gamma"): {0.0: "one-step returns: rewards are not carried back"},
  ("train", "gae_lambda"): {0.0: "TD(0) advantages"},
  ("train", "value_coef"): {0.0: "the critic is not trained (a frozen baseline)", _BIG: _WEIGHT},
  ("train", "value_clip"): {0.0: "the value loss unclipped", _BIG: _NO_BOUND},
  ("train", "pack_len"): {0: "the padded row length"},
  ("train", "logprob_chunk"): {0: "whole logits, no chunks", _HUGE: "one chunk: the whole row"},
  ("runtime", "max_lag_steps"): {0.0: "on-policy: no lag", _BIG: _NO_BOUND},
  ("runtime", "rollout_devices"): {0: "half of the devices"},
  ("runtime", "prefetch"): {0: "no prefetch: each mini-batch fetched when its update starts"},
  ("runtime", "locality_slack"): {0.0: "token balance first", _BIG: "locality first"},
  ("runtime", "ray_address"): {"": "a local Ray, started by the run"},
  ("runtime", "rollout_workers"): {0: "no Ray rollout workers"},
  ("runtime", "actor_restarts"): {
    0: "the first actor death stops the run",
    _HUGE: "actors restarted without limit",
  },
  ("runtime", "rollout_hosts"): {0: "no rollout hosts"},
  ("runtime", "rollout_listen"): {"": "read only with runtime.rollout_hosts > 0, checked there"},
  ("runtime", "rollout_host_wait_s"): {_BIG: "wait for the hosts without a time limit"},
  ("mesh", "cpu_devices"): {0: "JAX's own device count"},
  ("eval", "every_steps"): {0: "no evaluation while training"},
  ("eval", "samples"): {0: "greedy evaluation only"},
  ("eval", "reward"): {"": "the task's reward"},
  ("eval", "path"): {"": "the task's prompts"},
  ("eval", "max_new_tokens"): {0: "rollout.max_new_tokens"},
  ("model", "rope_theta"): {_BIG: "a RoPE base: any positive finite value is a valid one"},
  ("model", "norm_eps"): {_BIG: "a finite epsilon: the norm nearly scales by 1/sqrt(eps)"},
  ("model", "lora_rank"): {0: "no LoRA: full fine-tuning"},
  ("model", "lora_alpha"): {_BIG: "a finite adapter scale (B starts at 0)"},
  ("vision", "norm_eps"): {_BIG: "a finite epsilon: the norm nearly scales by 1/sqrt(eps)"},
}


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
