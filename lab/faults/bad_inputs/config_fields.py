"""The fields of a config and the values each refuses: wrong types, unknown choices, ranges."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Any

from hypothesis import strategies as st

from lab.faults.bad_inputs.core import Draw
from lab.faults.bad_inputs.strategies import (
  LIST,
  NEG_FLOAT,
  NEG_INT,
  NONPOS_FLOAT,
  NONPOS_INT,
  TEXT,
)


def section_classes() -> dict[str, type]:
  from knitjax import config
  from knitjax.models.transformer import TransformerConfig
  from knitjax.models.vision import VisionConfig

  return {**config.SECTIONS, "model": TransformerConfig, "vision": VisionConfig}


def pick_field(draw: Draw, d: dict, pick: Callable[[str, str, Any], bool]) -> tuple[str, str, Any]:
  """A (section, field, annotation) of a section present in ``d`` that ``pick`` selects."""
  options = []
  for section, cls in section_classes().items():
    if isinstance(d.get(section), dict):
      hints = typing.get_type_hints(cls)
      options += [
        (section, f.name, hints[f.name])
        for f in dataclasses.fields(cls)
        if f.init and pick(section, f.name, hints[f.name])
      ]
  return draw(st.sampled_from(options))


def field_names(section: str, field: str) -> tuple[str, ...]:
  return (f"config.{section}.{field}", f"{section_classes()[section].__name__}.{field}")


def wrong_type(annotation) -> st.SearchStrategy:
  origin = typing.get_origin(annotation)
  if annotation is bool:
    return st.one_of(st.integers(), TEXT, LIST, st.none())
  if annotation is int:
    return st.one_of(st.floats(allow_nan=False), TEXT, LIST, st.none(), st.booleans())
  if annotation is float:
    return st.one_of(TEXT, LIST, st.none(), st.booleans())
  if annotation is str:
    return st.one_of(st.integers(), st.floats(allow_nan=False), LIST, st.none(), st.booleans())
  if origin is tuple:
    return st.one_of(TEXT, st.integers(), st.none(), st.dictionaries(TEXT, st.integers()))
  if origin is Mapping:
    bad_values = st.one_of(st.floats(allow_nan=False), TEXT, st.none(), st.booleans(), LIST)
    return st.one_of(
      LIST,
      TEXT,
      st.integers(),
      st.none(),
      st.dictionaries(st.text(min_size=1, max_size=6), bad_values, min_size=1, max_size=3),
    )
  if typing.get_args(annotation) and type(None) in typing.get_args(annotation):
    # An optional section object (TransformerConfig.rope_scaling): anything but a mapping.
    return st.one_of(TEXT, st.integers(), LIST, st.booleans())
  raise TypeError(f"no wrong-type strategy for {annotation!r}.")


def field_choices() -> dict[tuple[str, str], tuple[str, ...]]:
  from knitjax import config, config_run, config_sections
  from knitjax.models import dtypes, vision
  from knitjax.rollout.contract import ADOPTION
  from knitjax.rollout.versions import LAG_UNITS
  from knitjax.tasks.registry import TASKS
  from knitjax.tasks.rewards import REWARDS
  from knitjax.train.kl import KL_ESTIMATORS
  from knitjax.train.losses import AGGREGATIONS, KL_PENALTIES, OBJECTIVES
  from knitjax.train.packing import PACKING_MODES
  from knitjax.train.prompt_sharing import PROMPT_SHARING_MODES
  from knitjax.train.ratios import RATIO_LEVELS
  from knitjax.train.step_advantages import ADVANTAGES
  from knitjax.transfer.admission import POLICIES

  return {
    ("task", "name"): TASKS,
    ("task", "reward"): tuple(REWARDS),
    ("rollout", "engine"): config_sections.ENGINES,
    ("loss", "advantage"): ADVANTAGES,
    ("loss", "aggregation"): AGGREGATIONS,
    ("loss", "objective"): OBJECTIVES,
    ("loss", "ratio_level"): RATIO_LEVELS,
    ("loss", "kl_estimator"): KL_ESTIMATORS,
    ("loss", "kl_penalty"): KL_PENALTIES,
    ("layout", "packing"): PACKING_MODES,
    ("layout", "prompt_sharing"): PROMPT_SHARING_MODES,
    ("admission", "policy"): POLICIES,
    ("topology", "mode"): config_run.MODES,
    ("sync", "every"): config_run.SYNC_EVERY,
    ("sync", "dtype"): config_run.SYNC_DTYPES,
    ("sync", "publish"): config_run.SYNC_PUBLISH,
    ("sync", "adoption"): ADOPTION,
    ("pipeline", "lag_unit"): LAG_UNITS,
    ("topology", "storage"): config_run.STORAGE,
    ("transfer", "mode"): config.TRANSFER,
    ("model", "dtype"): tuple(dtypes.DTYPES),
    ("vision", "dtype"): tuple(dtypes.DTYPES),
    ("vision", "mlp_act"): tuple(vision.ACTIVATIONS),
    ("vision", "projector_act"): tuple(vision.ACTIVATIONS),
    ("task", "chat"): config_sections.CHAT,
  }


# (section, field) -> values the field's validation refuses.
OUT_OF_RANGE = {
  **{("rollout", f): NONPOS_INT for f in ("group_size", "max_new_tokens", "slots", "decode_steps")},
  ("rollout", "refill_groups"): NONPOS_INT,
  ("rollout", "max_turns"): NONPOS_INT,
  ("rollout", "turn_tokens"): NEG_INT,
  ("rollout", "overlong_buffer"): NEG_INT,
  ("rollout", "prefill_chunk"): NEG_INT,
  ("rollout", "temperature"): NONPOS_FLOAT,
  ("rollout", "top_k"): NEG_INT,
  ("rollout", "top_p"): st.one_of(
    NONPOS_FLOAT, st.floats(min_value=1.0, exclude_min=True, allow_infinity=False)
  ),
  ("task", "prompt_len"): NEG_INT,
  ("optimizer", "lr"): NONPOS_FLOAT,
  ("optimizer", "warmup_steps"): NEG_INT,
  ("layout", "micro_batches"): NONPOS_INT,
  ("layout", "pack_len"): NEG_INT,
  ("layout", "pack_buckets"): NONPOS_INT,
  ("optimizer", "grad_clip"): NEG_FLOAT,
  **{("loss", f): NEG_FLOAT for f in ("tis_cap", "kl_coef", "kl_clamp")},
  **{("critic", f): NEG_FLOAT for f in ("value_coef", "value_clip")},
  **{
    ("critic", f): st.one_of(NEG_FLOAT, st.floats(min_value=1.0, exclude_min=True, max_value=1e6))
    for f in ("gamma", "gae_lambda")
  },
  # 0 is off; a dual-clip constant must exceed 1.
  ("loss", "eps_c"): st.one_of(
    NEG_FLOAT, st.floats(min_value=0.0, max_value=1.0, exclude_min=True, allow_infinity=False)
  ),
  ("admission", "minibatches"): NONPOS_INT,
  **{("loop", f): NONPOS_INT for f in ("steps", "log_every")},
  **{("topology", f): NEG_INT for f in ("rollout_workers", "actor_restarts", "rollout_devices")},
  ("pipeline", "prefetch"): NEG_INT,
  **{("pipeline", f): NEG_FLOAT for f in ("max_lag_steps", "locality_slack")},
  ("sync", "held_versions"): st.integers(max_value=1),  # every shipped config: new_groups
  ("mesh", "cpu_devices"): NEG_INT,
  **{("checkpoint", f): NONPOS_INT for f in ("every_steps", "keep")},
  **{
    ("model", f): NONPOS_INT
    for f in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "ffn_dim")
  },
  ("model", "head_dim"): st.one_of(NONPOS_INT, st.integers(0, 500).map(lambda k: 2 * k + 1)),
  ("model", "rope_theta"): NONPOS_FLOAT,
  ("model", "norm_eps"): NONPOS_FLOAT,
  **{
    ("vision", f): NONPOS_INT
    for f in ("image_size", "patch_size", "channels", "d_model", "num_layers", "num_heads")
  },
  **{("vision", f): NONPOS_INT for f in ("head_dim", "mlp_dim", "projector_dim")},
  ("vision", "norm_eps"): NONPOS_FLOAT,
}
# Ranges no validation checks yet, though a value outside them is meaningless (Adam's betas in
# [0, 1), PPO's clip range and weight decay >= 0).
UNCHECKED_RANGE = {
  ("optimizer", "b1"): st.one_of(NEG_FLOAT, st.floats(min_value=1.0, allow_infinity=False)),
  ("optimizer", "b2"): st.one_of(NEG_FLOAT, st.floats(min_value=1.0, allow_infinity=False)),
  ("loss", "eps_low"): NEG_FLOAT,
  ("loss", "eps_high"): NEG_FLOAT,
  ("optimizer", "weight_decay"): NEG_FLOAT,
}
