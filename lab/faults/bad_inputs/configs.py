"""Bad configs, fed to `knitjax.config.from_config_dict`: a shipped quick config, one corruption."""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable

from hypothesis import strategies as st

from lab.faults.bad_inputs.config_fields import (
  OUT_OF_RANGE,
  UNCHECKED_RANGE,
  field_choices,
  field_names,
  pick_field,
  section_classes,
  wrong_type,
)
from lab.faults.bad_inputs.core import BadInput, Case, Draw, baseline
from lab.faults.bad_inputs.strategies import (
  IDENT,
  LIST,
  NEG_INT,
  NON_FINITE,
  TEXT,
  not_in,
)


def context(folder: str) -> dict:
  from configs import arith_disagg, arith_tiny, count_vlm_tiny
  from knitjax import config

  bases = {
    m.__name__.split(".")[-1]: m.get_config("quick").to_dict()
    for m in (arith_tiny, arith_disagg, count_vlm_tiny)
  }
  for name, d in bases.items():
    baseline(f"config {name}", lambda d=d: config.from_config_dict(copy.deepcopy(d)))
  return {"bases": bases, "folder": folder}


def _config_input(draw: Draw, ctx: dict, *, vision: bool | None = None) -> tuple[str, dict]:
  names = sorted(ctx["bases"])
  if vision is not None:
    names = [n for n in names if ("vision" in ctx["bases"][n]) == vision]
  name = draw(st.sampled_from(names))
  return name, copy.deepcopy(ctx["bases"][name])


def _config_bad(name: str, d: dict, what: str, *names: str) -> BadInput:
  from knitjax.config import from_config_dict

  return BadInput(f"{name}: {what}", names, lambda: from_config_dict(d))


def _cfg_unknown_key(draw: Draw, ctx: dict) -> BadInput:
  name, d = _config_input(draw, ctx)
  section, _, _ = pick_field(draw, d, lambda *_: True)
  known = {f.name for f in dataclasses.fields(section_classes()[section])}
  key = draw(IDENT.filter(lambda k: k not in known))
  d[section][key] = draw(st.one_of(st.integers(), TEXT))
  return _config_bad(name, d, f"config.{section}.{key} added", f"config.{section}.{key}")


def _cfg_unknown_section(draw: Draw, ctx: dict) -> BadInput:
  name, d = _config_input(draw, ctx)
  key = draw(IDENT.filter(lambda k: k not in d and k not in section_classes()))
  d[key] = draw(st.one_of(st.dictionaries(IDENT, st.integers(), max_size=2), st.integers()))
  return _config_bad(name, d, f"config.{key} added", f"config.{key}")


def _cfg_wrong_type(draw: Draw, ctx: dict) -> BadInput:
  name, d = _config_input(draw, ctx)
  section, field, annotation = pick_field(draw, d, lambda *_: True)
  value = draw(wrong_type(annotation))
  d[section][field] = value
  return _config_bad(name, d, f"config.{section}.{field}={value!r}", *field_names(section, field))


def _cfg_non_finite(draw: Draw, ctx: dict) -> BadInput:
  name, d = _config_input(draw, ctx)
  section, field, _ = pick_field(draw, d, lambda s, f, a: a is float)
  d[section][field] = value = draw(NON_FINITE)
  return _config_bad(name, d, f"config.{section}.{field}={value}", *field_names(section, field))


def _cfg_bad_choice(draw: Draw, ctx: dict) -> BadInput:
  name, d = _config_input(draw, ctx)
  choices = field_choices()
  section, field, _ = pick_field(draw, d, lambda s, f, a: (s, f) in choices)
  d[section][field] = value = draw(not_in(choices[section, field]))
  return _config_bad(name, d, f"config.{section}.{field}={value!r}", *field_names(section, field))


def _cfg_range(table: dict) -> Callable[[Draw, dict], BadInput]:
  def make(draw: Draw, ctx: dict) -> BadInput:
    name, d = _config_input(draw, ctx)
    section, field, _ = pick_field(draw, d, lambda s, f, a: (s, f) in table)
    d[section][field] = value = draw(table[section, field])
    return _config_bad(name, d, f"config.{section}.{field}={value!r}", *field_names(section, field))

  return make


def _cfg_mesh_shape(draw: Draw, ctx: dict) -> BadInput:
  name, d = _config_input(draw, ctx)
  entry = st.one_of(st.integers(-1, 8), TEXT, st.floats(), st.none())
  wrong_length = st.lists(st.integers(-1, 8), max_size=6).filter(lambda s: len(s) != 3)
  bad_entry = st.tuples(
    st.integers(0, 2), st.one_of(st.just(0), st.integers(max_value=-2), TEXT, st.floats())
  )
  if draw(st.booleans()):
    shape = draw(wrong_length)
  else:
    shape = [draw(entry) for _ in range(3)]
    if draw(st.booleans()):
      i, value = draw(bad_entry)
      shape[i] = value
    else:  # two axes to infer
      i, j = draw(st.sampled_from([(0, 1), (0, 2), (1, 2)]))
      shape[i] = shape[j] = -1
  d["mesh"]["shape"] = tuple(shape)
  return _config_bad(name, d, f"config.mesh.shape={tuple(shape)!r}", "config.mesh.shape")


def _cfg_section_not_mapping(draw: Draw, ctx: dict) -> BadInput:
  name, d = _config_input(draw, ctx)
  section = draw(st.sampled_from(sorted(s for s in section_classes() if s in d)))
  truthy = st.one_of(st.integers().filter(bool), TEXT.filter(bool), LIST.filter(bool))
  value = draw(truthy if section == "vision" else st.one_of(truthy, st.none(), st.just([])))
  d[section] = value
  return _config_bad(name, d, f"config.{section}={value!r}", f"config.{section}")


def _cfg_model_field_missing(draw: Draw, ctx: dict) -> BadInput:
  from knitjax.models.transformer import TransformerConfig

  name, d = _config_input(draw, ctx)
  required = [
    f.name for f in dataclasses.fields(TransformerConfig) if f.default is dataclasses.MISSING
  ]
  field = draw(st.sampled_from(required))
  del d["model"][field]
  return _config_bad(name, d, f"config.model.{field} removed", f"config.model.{field}", field)


def _cfg_quotas(draw: Draw, ctx: dict) -> BadInput:
  name, d = _config_input(draw, ctx)
  admission = d["admission"]
  classes = sorted(admission["quotas"])
  c = draw(st.sampled_from(classes))
  how = draw(st.sampled_from(["not_int", "not_positive", "indivisible", "empty"]))
  if how == "not_int":
    admission["quotas"][c] = draw(st.one_of(st.floats(), TEXT, st.none(), st.booleans(), LIST))
  elif how == "not_positive":
    admission["quotas"][c] = draw(st.integers(max_value=0))
  elif how == "indivisible":
    m = draw(st.integers(2, 8))
    quotas = {k: draw(st.integers(1, 64)) for k in classes}
    if sum(quotas.values()) % m == 0:
      quotas[c] += 1
    admission.update(quotas=quotas, minibatches=m)
  else:
    admission["quotas"] = {}
  what = f"config.admission.quotas={admission['quotas']!r} minibatches={admission['minibatches']}"
  return _config_bad(name, d, what, "config.admission.quotas")


def _cfg_minibatch_bounds(draw: Draw, ctx: dict) -> BadInput:
  name, d = _config_input(draw, ctx)
  admission = d["admission"]
  field = draw(st.sampled_from(["min_per_minibatch", "max_per_minibatch"]))
  if draw(st.booleans()):  # a class the quotas do not name
    c = draw(IDENT.filter(lambda k: k not in admission["quotas"]))
    value = draw(st.integers(0, 8))
  else:
    c = draw(st.sampled_from(sorted(admission["quotas"])))
    value = draw(NEG_INT)
  admission[field] = {**admission[field], c: value}
  return _config_bad(
    name, d, f"config.admission.{field}={admission[field]!r}", f"config.admission.{field}"
  )


def _cfg_cross_field(draw: Draw, ctx: dict) -> BadInput:
  how = draw(
    st.sampled_from(
      [
        "vision_on_text_task",
        "vision_continuous_engine",
        "class_budget_unknown_class",
        "class_budget_out_of_range",
        "micro_batches_indivisible",
        "kv_heads_indivisible",
        "patch_size_over_image",
        "file_task_without_path",
      ]
    )
  )
  vision = {
    "vision_on_text_task": False,
    "vision_continuous_engine": True,
    "patch_size_over_image": True,
    "file_task_without_path": False,
  }.get(how)
  name, d = _config_input(draw, ctx, vision=vision)
  if how == "vision_on_text_task":
    vlm = next(b for b in ctx["bases"].values() if "vision" in b)
    d["vision"] = copy.deepcopy(vlm["vision"])
    return _config_bad(name, d, "config.vision added to a text task", "config.vision")
  if how == "vision_continuous_engine":
    d["rollout"]["engine"] = "continuous"
    return _config_bad(name, d, "VLM with engine='continuous'", "config.rollout.engine")
  if how.startswith("class_budget"):
    budgets, quotas = d["rollout"]["class_max_new_tokens"], d["admission"]["quotas"]
    if how == "class_budget_unknown_class":
      c, value = draw(IDENT.filter(lambda k: k not in quotas)), 1
    else:
      top = d["rollout"]["max_new_tokens"]
      c = draw(st.sampled_from(sorted(quotas)))
      value = draw(st.one_of(st.integers(max_value=0), st.integers(min_value=top + 1)))
    d["rollout"]["class_max_new_tokens"] = {**budgets, c: value}
    what = f"config.rollout.class_max_new_tokens[{c!r}]={value}"
    return _config_bad(name, d, what, "config.rollout.class_max_new_tokens")
  if how == "micro_batches_indivisible":
    a = d["admission"]
    rows = sum(a["quotas"].values()) // a["minibatches"] * d["rollout"]["group_size"]
    m = draw(st.integers(2, 4 * rows).filter(lambda m: rows % m))
    d["layout"]["micro_batches"] = m
    return _config_bad(
      name, d, f"config.layout.micro_batches={m} ({rows} rows)", "config.layout.micro_batches"
    )
  if how == "kv_heads_indivisible":
    heads = d["model"]["num_heads"]
    d["model"]["num_kv_heads"] = kv = draw(st.integers(1, 64).filter(lambda k: heads % k))
    return _config_bad(name, d, f"num_heads={heads} num_kv_heads={kv}", "num_kv_heads")
  if how == "patch_size_over_image":
    size = d["vision"]["image_size"]
    # A patch larger than the image: refused. (A patch that does not divide the image is
    # accepted: the last rows / columns are dropped, as a stride-p convolution does, which is
    # how SigLIP checkpoints such as 384 px with 14 px patches are read.)
    d["vision"]["patch_size"] = p = draw(st.integers(size + 1, size + 64))
    return _config_bad(name, d, f"vision image_size={size} patch_size={p}", "patch_size")
  d["task"].update(name="gsm8k", reward="numeric_match", path="")
  return _config_bad(name, d, "task gsm8k without config.task.path", "config.task.path")


def _cfg_top_level(draw: Draw, ctx: dict) -> BadInput:
  name, d = _config_input(draw, ctx)
  if draw(st.booleans()):
    d["seed"] = value = draw(st.one_of(st.floats(), TEXT, LIST, st.booleans()))
    return _config_bad(name, d, f"config.seed={value!r}", "config.seed")
  folder = ctx["folder"]
  value = draw(
    st.one_of(
      st.integers().filter(bool),
      LIST.filter(bool),
      st.just(True),
      IDENT.map(lambda s: os.path.join(folder, "no_such_folder_" + s)),
      st.just(os.path.join(folder, "a_file")),
    )
  )
  if isinstance(value, str) and value.endswith("a_file"):
    with open(value, "w") as f:
      f.write("{}")
  d["init_from"] = value
  return _config_bad(name, d, f"config.init_from={value!r}", "config.init_from")


CASES: list[Case] = [
  ("unknown_key", _cfg_unknown_key),
  ("unknown_section", _cfg_unknown_section),
  ("wrong_type", _cfg_wrong_type),
  ("non_finite", _cfg_non_finite),
  ("bad_choice", _cfg_bad_choice),
  ("out_of_range", _cfg_range(OUT_OF_RANGE)),
  ("unchecked_range", _cfg_range(UNCHECKED_RANGE)),
  ("mesh_shape", _cfg_mesh_shape),
  ("section_not_mapping", _cfg_section_not_mapping),
  ("model_field_missing", _cfg_model_field_missing),
  ("quotas", _cfg_quotas),
  ("minibatch_bounds", _cfg_minibatch_bounds),
  ("cross_field", _cfg_cross_field),
  ("top_level", _cfg_top_level),
]
