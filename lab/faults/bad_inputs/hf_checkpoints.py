"""Bad Hugging Face checkpoint folders: `knitjax.models.hf.config_from_hf` / `load_hf_params`."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
from collections.abc import Callable

import numpy as np
from hypothesis import strategies as st

from lab.faults.bad_inputs.core import BadInput, Case, Draw, baseline, fresh_copy
from lab.faults.bad_inputs.strategies import (
  IDENT,
  LIST,
  NON_FINITE,
  NONPOS_FLOAT,
  NOT_INT,
  TEXT,
  not_in,
  not_json,
  not_object_json,
)

_HF_REQUIRED = (
  "vocab_size",
  "hidden_size",
  "intermediate_size",
  "num_hidden_layers",
  "num_attention_heads",
)
# config.json keys -> the TransformerConfig field a rejection may name instead.
_HF_ALIASES = {"num_key_value_heads": "num_kv_heads", "rms_norm_eps": "norm_eps"}


def context(folder: str) -> dict:
  from flax import nnx

  from knitjax.models import hf
  from knitjax.models.transformer import Transformer, TransformerConfig

  config = TransformerConfig(
    vocab_size=32,
    num_layers=1,
    d_model=16,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    ffn_dim=24,
    qk_norm=True,
    tie_embeddings=False,
  )
  model = Transformer(config, rngs=nnx.Rngs(0))
  pristine, sharded = os.path.join(folder, "pristine"), os.path.join(folder, "sharded")
  for path in (pristine, sharded):
    shutil.rmtree(path, ignore_errors=True)
  hf.save_hf_params(model, config, pristine)
  hf.save_hf_params(model, config, sharded, max_shard_bytes=3000)
  abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[1]
  for path in (pristine, sharded):
    baseline(f"checkpoint {path}", lambda path=path: hf.load_hf_params(path, abstract))
  with open(os.path.join(pristine, hf.CONFIG_FILE)) as f:
    config_json = json.load(f)
  return {
    "folder": folder,
    "pristine": pristine,
    "sharded": sharded,
    "abstract": abstract,
    "model": model,
    "config_json": config_json,
    "tensors": hf.read_safetensors(pristine),
    "n": 0,
    "last": None,
  }


def _hf_config(draw: Draw, ctx: dict, change: Callable[[dict], tuple[str, str]]) -> BadInput:
  """config.json with one change; ``change`` edits the dict and returns (what, name)."""
  from knitjax.models import hf

  path = fresh_copy(ctx)
  d = copy.deepcopy(ctx["config_json"])
  what, name = change(d)
  with open(os.path.join(path, hf.CONFIG_FILE), "w") as f:
    json.dump(d, f)
  names = (name, _HF_ALIASES.get(name, name))
  return BadInput(f"config.json {what}", names, lambda: hf.config_from_hf(path), file_errors=True)


def _hf_config_text(draw: Draw, ctx: dict) -> BadInput:
  from knitjax.models import hf

  path = fresh_copy(ctx)
  good = json.dumps(ctx["config_json"]).encode()
  content = draw(
    st.one_of(
      st.integers(0, len(good) - 1).map(lambda n: good[:n]),
      st.binary(max_size=20).map(lambda b: b"\xff" + b),
      not_object_json(),
    )
  )
  with open(os.path.join(path, hf.CONFIG_FILE), "wb") as f:
    f.write(content)
  what = f"config.json = {content[:80]!r}"
  return BadInput(what, (hf.CONFIG_FILE,), lambda: hf.config_from_hf(path), file_errors=True)


def _hf_model_type(draw: Draw, ctx: dict) -> BadInput:
  def change(d):
    if draw(st.booleans()):
      del d["model_type"]
      return "without model_type", "model_type"
    d["model_type"] = value = draw(st.one_of(not_in(("llama", "qwen2", "qwen3")), NOT_INT))
    return f"model_type={value!r}", "model_type"

  return _hf_config(draw, ctx, change)


def _hf_required(draw: Draw, ctx: dict) -> BadInput:
  def change(d):
    key = draw(st.sampled_from(_HF_REQUIRED))
    if draw(st.booleans()):
      del d[key]
      return f"without {key}", key
    d[key] = value = draw(st.one_of(st.integers(max_value=0), NOT_INT))
    return f"{key}={value!r}", key

  return _hf_config(draw, ctx, change)


def _hf_unsupported(draw: Draw, ctx: dict) -> BadInput:
  rope_types = st.one_of(
    st.sampled_from(["linear", "dynamic", "yarn", "llama3", "longrope"]), IDENT
  )
  rope_spec = st.one_of(
    st.builds(
      lambda k, t: {k: t},
      st.sampled_from(["rope_type", "type"]),
      rope_types.filter(lambda t: t != "default"),
    ),
    st.one_of(TEXT.filter(bool), LIST.filter(bool), st.integers().filter(bool)),
  )
  options = {
    "hidden_act": st.one_of(not_in(("silu",)), st.integers(), st.none(), LIST),
    "rope_scaling": rope_spec,
    "rope_parameters": rope_spec,
    "partial_rotary_factor": st.floats(allow_nan=False, allow_infinity=False).filter(
      lambda f: f != 1.0
    ),
    "use_sliding_window": st.just(True),
    "layer_types": st.lists(not_in(("full_attention",)), min_size=1, max_size=2),
    "attention_bias": st.just(True),
    "mlp_bias": st.just(True),
  }

  def change(d):
    key = draw(st.sampled_from(sorted(options)))
    d[key] = value = draw(options[key])
    return f"{key}={value!r}", key

  return _hf_config(draw, ctx, change)


def _not_a_float(text: str) -> bool:
  try:
    float(text)
  except ValueError:
    return True
  return False


def _hf_optional_numbers(draw: Draw, ctx: dict) -> BadInput:
  heads = ctx["config_json"]["num_attention_heads"]
  not_number = st.one_of(TEXT.filter(_not_a_float), LIST, st.dictionaries(TEXT, st.integers()))
  not_int = NOT_INT.filter(lambda v: v is not None)  # null: Hugging Face derives the value
  options = {
    "num_key_value_heads": st.one_of(
      st.integers(max_value=0), st.integers(1, 64).filter(lambda k: heads % k), not_int
    ),
    "head_dim": st.one_of(
      st.integers(max_value=0), st.integers(0, 100).map(lambda k: 2 * k + 1), not_int
    ),
    "rms_norm_eps": st.one_of(NONPOS_FLOAT, NON_FINITE, not_number),
    "rope_theta": st.one_of(NONPOS_FLOAT, NON_FINITE, not_number),
    "tie_word_embeddings": st.one_of(TEXT, LIST),
  }

  def change(d):
    key = draw(st.sampled_from(sorted(options)))
    d[key] = value = draw(options[key])
    return f"{key}={value!r}", key

  return _hf_config(draw, ctx, change)


def _hf_tensors(draw: Draw, ctx: dict, change: Callable[[dict], tuple[str, str]]) -> BadInput:
  """model.safetensors rewritten with one change; ``change`` edits the tensors dict."""
  from knitjax.models import hf, safetensors_io

  path = fresh_copy(ctx)
  tensors = dict(ctx["tensors"])
  what, name = change(tensors)
  safetensors_io.write_safetensors(os.path.join(path, hf.WEIGHTS_FILE), tensors)
  call = lambda: hf.load_hf_params(path, ctx["abstract"])
  return BadInput(f"model.safetensors: {what}", (name,), call, file_errors=True)


def _hf_missing_tensor(draw: Draw, ctx: dict) -> BadInput:
  def change(tensors):
    name = draw(st.sampled_from(sorted(tensors)))
    del tensors[name]
    return f"without {name}", name

  return _hf_tensors(draw, ctx, change)


def _hf_wrong_shape(draw: Draw, ctx: dict) -> BadInput:
  def change(tensors):
    name = draw(st.sampled_from(sorted(tensors)))
    shape = tensors[name].shape
    new = tuple(
      draw(st.lists(st.integers(1, 40), min_size=1, max_size=3).filter(lambda s: tuple(s) != shape))
    )
    tensors[name] = np.zeros(new, np.float32)
    return f"{name} with shape {new}, not {shape}", name

  return _hf_tensors(draw, ctx, change)


def _hf_extra_tensor(draw: Draw, ctx: dict) -> BadInput:
  def change(tensors):
    name = draw(IDENT.map(lambda s: f"model.{s}.weight").filter(lambda n: n not in tensors))
    tensors[name] = np.zeros(draw(st.lists(st.integers(1, 4), max_size=2)), np.float32)
    return f"extra tensor {name}", name

  return _hf_tensors(draw, ctx, change)


def _raw(file: str) -> tuple[dict, bytes]:
  with open(file, "rb") as f:
    blob = f.read()
  n = int.from_bytes(blob[:8], "little")
  return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _write_raw(file: str, header: bytes, data: bytes, length: int | None = None) -> None:
  with open(file, "wb") as f:
    f.write((len(header) if length is None else length).to_bytes(8, "little") + header + data)


def _hf_weights_file(draw: Draw, ctx: dict) -> BadInput:
  """A damaged model.safetensors: truncated, or a header that is not a valid one."""
  from knitjax.models import hf

  path = fresh_copy(ctx)
  file = os.path.join(path, hf.WEIGHTS_FILE)
  header, data = _raw(file)
  size = os.path.getsize(file)
  name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
  how = draw(
    st.sampled_from(
      ["truncated", "length", "not_json", "not_object", "entry", "dtype", "offsets", "shape"]
    )
  )
  if how == "truncated":
    n = draw(st.integers(0, size - 1))
    os.truncate(file, n)
    what = f"truncated to {n} of {size} bytes"
  elif how == "length":
    blob = json.dumps(header).encode()
    n = draw(st.one_of(st.just(0), st.integers(len(blob) + len(data) + 1, 2**64 - 1)))
    _write_raw(file, blob, data, length=n)
    what = f"header length {n}"
  elif how == "not_json":
    blob = draw(
      st.one_of(
        st.binary(min_size=1, max_size=60).map(lambda b: b"\xff" + b),
        st.text(min_size=1, max_size=60).filter(not_json).map(str.encode),
      )
    )
    _write_raw(file, blob, data)
    what = f"header {blob[:60]!r}"
  elif how == "not_object":
    blob = draw(not_object_json())
    _write_raw(file, blob, data)
    what = f"header {blob[:60]!r}"
  else:
    entry = header[name]
    if how == "entry":
      key = draw(st.sampled_from(sorted(entry)))
      del entry[key]
      what = f"{name} without {key}"
    elif how == "dtype":
      entry["dtype"] = draw(
        st.one_of(st.sampled_from(["I32", "I64", "U8", "BOOL", "F8_E4M3"]), NOT_INT)
      )
      what = f"{name} dtype {entry['dtype']!r}"
    elif how == "offsets":
      begin, end = entry["data_offsets"]
      entry["data_offsets"] = draw(
        st.one_of(
          st.lists(st.integers(0, end), max_size=3).filter(lambda o: o != [begin, end]),
          st.tuples(st.just(begin), st.integers(end + 1, 2**40)).map(list),
          TEXT,
          st.none(),
        )
      )
      what = f"{name} data_offsets {entry['data_offsets']!r}"
    else:
      entry["shape"] = draw(
        st.one_of(
          st.lists(st.integers(-40, 40), min_size=1, max_size=3).filter(
            lambda s: s != entry["shape"]
          ),
          TEXT,
          st.none(),
          st.lists(TEXT, min_size=1, max_size=2),
        )
      )
      what = f"{name} shape {entry['shape']!r}"
    _write_raw(file, json.dumps(header).encode(), data)
  names = (hf.WEIGHTS_FILE,)
  call = lambda: hf.load_hf_params(path, ctx["abstract"])
  return BadInput(f"model.safetensors {what}", names, call, file_errors=True)


def _hf_sharded(draw: Draw, ctx: dict) -> BadInput:
  """A sharded checkpoint with a bad index or a missing shard."""
  from knitjax.models import hf

  path = fresh_copy(ctx, "sharded")
  index_file = os.path.join(path, hf.INDEX_FILE)
  with open(index_file) as f:
    index = json.load(f)
  weight_map = index["weight_map"]
  shards = sorted(set(weight_map.values()))
  how = draw(st.sampled_from(["not_json", "missing_shard", "unknown_shard", "wrong_shard"]))
  if how == "not_json":
    good = json.dumps(index).encode()
    with open(index_file, "wb") as f:
      f.write(good[: draw(st.integers(0, len(good) - 1))])
    name, what = hf.INDEX_FILE, "truncated"
  elif how == "missing_shard":
    name = draw(st.sampled_from(shards))
    os.remove(os.path.join(path, name))
    what = f"{name} deleted"
  else:
    tensor = draw(st.sampled_from(sorted(weight_map)))
    if how == "unknown_shard":
      shard = draw(IDENT.map(lambda s: f"{s}.safetensors"))
    else:
      shard = draw(st.sampled_from([s for s in shards if s != weight_map[tensor]]))
    weight_map[tensor] = name = shard
    with open(index_file, "w") as f:
      json.dump(index, f)
    what = f"maps {tensor} to {shard}"
  call = lambda: hf.load_hf_params(path, ctx["abstract"])
  return BadInput(f"{hf.INDEX_FILE} {how}: {what}", (name,), call, file_errors=True)


def _hf_other_config(draw: Draw, ctx: dict) -> BadInput:
  """A folder whose config.json describes another model than the one loading it."""

  def change(d):
    key = draw(st.sampled_from(["vocab_size", "intermediate_size", "rope_theta", "rms_norm_eps"]))
    d[key] = value = draw(st.integers(2, 64).filter(lambda v: v != d[key]))
    return f"{key}={value}", key

  from knitjax.models import hf

  bad = _hf_config(draw, ctx, change)
  path = ctx["last"]
  call = lambda: hf.load_hf_params(path, ctx["model"])
  return dataclasses.replace(bad, names=(hf.CONFIG_FILE,), call=call)


CASES: list[Case] = [
  ("config_text", _hf_config_text),
  ("model_type", _hf_model_type),
  ("required_field", _hf_required),
  ("unsupported_option", _hf_unsupported),
  ("optional_numbers", _hf_optional_numbers),
  ("missing_tensor", _hf_missing_tensor),
  ("wrong_shape", _hf_wrong_shape),
  ("extra_tensor", _hf_extra_tensor),
  ("weights_file", _hf_weights_file),
  ("sharded", _hf_sharded),
  ("other_config", _hf_other_config),
]
