"""Hugging Face `config.json` <-> knitjax's `TransformerConfig`, for Qwen2 / Qwen3 / Llama.

`config_from_hf` reads a checkpoint's `config.json` (or its parsed dict), checks every field
knitjax's decoder depends on and refuses, in one sentence naming the field, any option it does
not implement (RoPE scaling other than linear / llama3 / yarn, sliding windows, biases the family
lacks). RoPE settings come from either format: transformers 4.x (`rope_theta` + a `rope_scaling`
dict) or 5.x (a `rope_parameters` dict). `config_to_hf` writes the inverse, picking the family
from the config (qk_norm -> qwen3, qkv_bias -> qwen2, else llama).
The weights themselves are mapped by `knitjax.models.hf`, which re-exports these names.
"""

import dataclasses
import json
import os
import sys
from collections.abc import Mapping

from knitjax.models.layers import ROPE_SCALING_FIELDS, RopeScaling, yarn_mscale
from knitjax.models.transformer import TransformerConfig

CONFIG_FILE = "config.json"

_ARCHITECTURES = {
  "llama": "LlamaForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
}
_REQUIRED = (
  "vocab_size",
  "hidden_size",
  "intermediate_size",
  "num_hidden_layers",
  "num_attention_heads",
)
_MAX = sys.float_info.max
# Layers of the deepest released decoders: ~126 (Llama-3.1-405B). Tracing the model takes time
# in proportion: 100,000 layers took minutes before any other check could speak.
MAX_LAYERS = 1024
PARAM_BYTES = 4  # params are float32, whatever the compute dtype


def param_count(config: TransformerConfig) -> int:
  """The decoder's parameter count (embedding, layers, head; adapters and value head aside)."""
  d, q, kv = (
    config.d_model,
    config.num_heads * config.head_dim,
    config.num_kv_heads * config.head_dim,
  )
  attention = (
    d * (q + 2 * kv) + q * d + (q + 2 * kv) * config.qkv_bias + 2 * config.head_dim * config.qk_norm
  )
  layer = attention + 3 * d * config.ffn_dim + 2 * d
  head = 0 if config.tie_embeddings else config.vocab_size * d
  return config.vocab_size * d + config.num_layers * layer + d + head


def host_memory_bytes() -> int:
  """This machine's physical memory."""
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_model_fits(config: TransformerConfig, where: str, memory: int, what: str) -> None:
  """Raises one sentence when the model's float32 params alone exceed ``memory`` bytes."""
  need = param_count(config) * PARAM_BYTES
  if need > memory:
    raise ValueError(
      f"{where} describes a model of {param_count(config):,} parameters ({need / 2**30:,.1f} GiB "
      f"in float32), more than the {memory / 2**30:,.1f} GiB of {what}."
    )


def _read_json(path: str) -> dict:
  """The JSON object in ``path``; a missing, unreadable or malformed file is one ValueError."""
  try:
    with open(path, "rb") as f:
      value = json.loads(f.read().decode("utf-8"))
  except FileNotFoundError:
    raise ValueError(
      f"{path} does not exist; a Hugging Face checkpoint folder is needed."
    ) from None
  except OSError as e:
    raise ValueError(f"{path} cannot be read ({e.strerror or type(e).__name__}).") from None
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ValueError(f"{path} is not UTF-8 JSON ({reason}); accepted: a JSON object.") from None
  if not isinstance(value, dict):
    raise ValueError(f"{path} holds {json.dumps(value):.60}; accepted: a JSON object.")
  return value


def _positive_int(value, key: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:  # True is an int too
    raise ValueError(f"config.json {key} must be a positive integer, got {value!r}.")
  return value


def _positive_real(value, key: str) -> float:
  # The upper bound keeps out inf, and ints too big for a float; nan fails every comparison.
  if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= _MAX:
    raise ValueError(f"config.json {key} must be a finite number > 0, got {value!r}.")
  return float(value)


def _finite_real(value, key: str) -> float:
  if isinstance(value, bool) or not isinstance(value, int | float) or not -_MAX <= value <= _MAX:
    raise ValueError(f"config.json {key} must be a finite number, got {value!r}.")
  return float(value)


def _flag(hf: Mapping, key: str) -> bool:
  """A boolean field; missing or null is false, as in Hugging Face's configs of these families."""
  value = hf.get(key)
  if value is not None and not isinstance(value, bool):
    raise ValueError(f"config.json {key} must be true or false, got {value!r}.")
  return bool(value)


def _rope_scaling(hf: Mapping, key: str, spec: dict) -> RopeScaling | None:
  """The `RopeScaling` of a config.json rope dict, resolved as transformers 5 resolves it."""
  rope_type = spec.get("rope_type", spec.get("type", "default"))
  if rope_type == "default":
    return None
  if not isinstance(rope_type, str) or rope_type not in ROPE_SCALING_FIELDS:
    raise ValueError(
      f"config.json {key} has rope type {rope_type!r}; accepted: null, "
      f"{', '.join(repr(t) for t in ['default', *sorted(ROPE_SCALING_FIELDS)])}."
    )
  rotary = spec.get("partial_rotary_factor", 1.0)
  if isinstance(rotary, bool) or rotary != 1.0:
    raise ValueError(
      f"config.json {key}.partial_rotary_factor must be 1.0 (RoPE on the whole head), "
      f"got {rotary!r}."
    )
  used = ROPE_SCALING_FIELDS[rope_type]

  def lacks(field: str) -> ValueError:
    return ValueError(f"config.json {key} has rope type {rope_type!r} without the field {field!r}.")

  if "factor" not in spec:
    raise lacks("factor")
  fields = {}
  if "original_max_position_embeddings" in used:
    name, value = (
      f"{key}.original_max_position_embeddings",
      spec.get("original_max_position_embeddings"),
    )
    if value is None:  # transformers falls back to max_position_embeddings
      name, value = "max_position_embeddings", hf.get("max_position_embeddings")
    if value is None:
      raise lacks("original_max_position_embeddings")
    fields["original_max_position_embeddings"] = _positive_int(value, name)
  factor = spec["factor"]
  if factor is None and rope_type == "yarn" and hf.get("max_position_embeddings") is not None:
    # transformers: the post-YaRN over the pre-YaRN context length.
    length = _positive_int(hf["max_position_embeddings"], "max_position_embeddings")
    factor = length / fields["original_max_position_embeddings"]
  factor = _positive_real(factor, f"{key}.factor")
  if rope_type == "llama3":
    for name in ("low_freq_factor", "high_freq_factor"):
      if name not in spec:
        raise lacks(name)
      fields[name] = _positive_real(spec[name], f"{key}.{name}")
  if rope_type == "yarn":
    for name in ("beta_fast", "beta_slow"):
      if spec.get(name):  # transformers: `beta_fast or 32`
        fields[name] = _positive_real(spec[name], f"{key}.{name}")
    if spec.get("attention_factor") is not None:  # null: derived from factor (and mscale)
      fields["attention_factor"] = _positive_real(
        spec["attention_factor"], f"{key}.attention_factor"
      )
    mscale = {}
    for name in ("mscale", "mscale_all_dim"):
      if spec.get(name) is not None:
        mscale[name] = _finite_real(spec[name], f"{key}.{name}")
    if "attention_factor" not in fields and mscale.get("mscale") and mscale.get("mscale_all_dim"):
      fields["attention_factor"] = yarn_mscale(factor, mscale["mscale"]) / yarn_mscale(
        factor, mscale["mscale_all_dim"]
      )
    truncate = spec.get("truncate", True)
    if truncate is not None and not isinstance(truncate, bool):
      raise ValueError(f"config.json {key}.truncate must be true or false, got {truncate!r}.")
    if not truncate:  # transformers tests `if truncate:`, so null turns it off too
      fields["truncate"] = False
  try:
    return RopeScaling(rope_type=rope_type, factor=factor, **fields)
  except ValueError as e:  # a cross-field rule, e.g. high_freq_factor > low_freq_factor
    raise ValueError(f"config.json {key} is not accepted: {e}") from None


def config_from_hf(path_or_dict: str | os.PathLike | Mapping, *, dtype: str = "float32"):
  """The `TransformerConfig` of a Hugging Face `config.json` (Qwen2 / Qwen3 / Llama).

  Args:
    path_or_dict: a checkpoint folder, the path of its `config.json`, or the parsed dict.
    dtype: knitjax's compute dtype ("float32" | "bfloat16"); params are always float32.

  Raises:
    ValueError: one sentence naming config.json and the field, for an unreadable file, a field
      of the wrong type or range, or a model type, RoPE scaling type, sliding window or other
      option knitjax's decoder does not implement.
  """
  if isinstance(path_or_dict, Mapping):
    hf = dict(path_or_dict)
  else:
    path = os.fspath(path_or_dict)
    hf = _read_json(os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path)
  family = hf.get("model_type")
  if not isinstance(family, str) or family not in _ARCHITECTURES:
    raise ValueError(
      f"config.json model_type={family!r} is not supported; accepted: {sorted(_ARCHITECTURES)}."
    )
  for key in _REQUIRED:
    if key not in hf:
      raise ValueError(f"config.json of model_type {family!r} lacks the required field {key!r}.")
    _positive_int(hf[key], key)
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json hidden_act={hf['hidden_act']!r} is not supported; only 'silu'.")
  specs = {}
  for spec_key in ("rope_scaling", "rope_parameters"):
    specs[spec_key] = spec = {} if hf.get(spec_key) is None else hf[spec_key]
    if not isinstance(spec, dict):
      raise ValueError(f"config.json {spec_key} must be an object or null, got {spec!r}.")
  # transformers 4.x: rope_scaling (+ top-level rope_theta); 5.x: rope_parameters. When both are
  # given, 5.x uses rope_scaling; a disagreement is refused rather than resolved silently.
  scalings = {key: _rope_scaling(hf, key, spec) for key, spec in specs.items() if spec}
  if len(set(scalings.values())) > 1:
    raise ValueError(
      "config.json rope_scaling and rope_parameters give different RoPE scalings; accepted: "
      "one of them, or both the same."
    )
  rope_scaling = next(iter(scalings.values()), None)
  rotary = hf.get("partial_rotary_factor", 1.0)
  if isinstance(rotary, bool) or rotary != 1.0:
    raise ValueError(
      f"config.json partial_rotary_factor must be 1.0 (RoPE on the whole head), got {rotary!r}."
    )
  if _flag(hf, "use_sliding_window"):
    raise ValueError("config.json use_sliding_window=true is not supported; accepted: false.")
  layer_types = hf.get("layer_types")
  if layer_types is not None and (
    not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types)
  ):
    raise ValueError("config.json layer_types must all be 'full_attention' (no sliding window).")
  if family != "qwen2" and _flag(hf, "attention_bias"):
    raise ValueError(f"config.json attention_bias=true ({family}) is not supported; only false.")
  if _flag(hf, "mlp_bias"):
    raise ValueError("config.json mlp_bias=true is not supported; accepted: false.")

  if hf["num_hidden_layers"] > MAX_LAYERS:
    raise ValueError(
      f"config.json num_hidden_layers={hf['num_hidden_layers']} is not accepted; it must be at "
      f"most {MAX_LAYERS} (the deepest released decoders have ~126)."
    )
  heads = hf["num_attention_heads"]
  kv_heads = hf.get("num_key_value_heads")  # only a missing or null value means "as many as heads"
  kv_heads = heads if kv_heads is None else _positive_int(kv_heads, "num_key_value_heads")
  if heads % kv_heads:
    raise ValueError(
      f"config.json num_key_value_heads={kv_heads} must divide num_attention_heads={heads}."
    )
  head_dim = hf.get("head_dim")
  if head_dim is None:  # Hugging Face's own defaults: Qwen3Config says 128, the others derive it
    head_dim = 128 if family == "qwen3" else hf["hidden_size"] // heads
    derived = " (hidden_size // num_attention_heads)"
  else:
    head_dim, derived = _positive_int(head_dim, "head_dim"), ""
  if head_dim < 2 or head_dim % 2:
    raise ValueError(
      f"config.json head_dim must be an even integer >= 2 (RoPE), got {head_dim}{derived}."
    )
  if "rope_theta" in hf or "rope_theta" not in specs["rope_parameters"]:
    rope_theta = _positive_real(hf.get("rope_theta", 10_000.0), "rope_theta")
  else:  # transformers v5 keeps it inside rope_parameters
    rope_theta = _positive_real(
      specs["rope_parameters"]["rope_theta"], "rope_parameters.rope_theta"
    )
  try:
    return _decoder_config(hf, family, heads, kv_heads, head_dim, rope_theta, rope_scaling, dtype)
  except ValueError as e:  # a shape knitjax refuses (too deep, too wide): in config.json's words
    message = str(e)
    if not message.startswith("TransformerConfig."):
      raise
    for ours, theirs in _HF_NAMES.items():
      message = message.replace(f"TransformerConfig.{ours}", theirs)
    raise ValueError(f"config.json: {message}") from None


# TransformerConfig's field -> config.json's key
_HF_NAMES = {
  "vocab_size": "vocab_size",
  "num_layers": "num_hidden_layers",
  "d_model": "hidden_size",
  "num_heads": "num_attention_heads",
  "num_kv_heads": "num_key_value_heads",
  "head_dim": "head_dim",
  "ffn_dim": "intermediate_size",
}


def _decoder_config(hf, family, heads, kv_heads, head_dim, rope_theta, rope_scaling, dtype):
  return TransformerConfig(
    vocab_size=hf["vocab_size"],
    num_layers=hf["num_hidden_layers"],
    d_model=hf["hidden_size"],
    num_heads=heads,
    num_kv_heads=kv_heads,
    head_dim=head_dim,
    ffn_dim=hf["intermediate_size"],
    rope_theta=rope_theta,
    rope_scaling=rope_scaling,
    norm_eps=_positive_real(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
    tie_embeddings=_flag(hf, "tie_word_embeddings"),
    qk_norm=family == "qwen3",
    qkv_bias=family == "qwen2",
    dtype=dtype,
  )


def _family(config: TransformerConfig) -> str:
  if config.qk_norm and config.qkv_bias:
    raise ValueError("no Hugging Face family has both qk_norm and qkv_bias; cannot export it.")
  return "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else "llama"


def config_to_hf(config: TransformerConfig, *, torch_dtype: str = "float32") -> dict:
  """The Hugging Face `config.json` dict of a knitjax decoder config (inverse of config_from_hf)."""
  family = _family(config)
  hf = {
    "architectures": [_ARCHITECTURES[family]],
    "model_type": family,
    "vocab_size": config.vocab_size,
    "hidden_size": config.d_model,
    "intermediate_size": config.ffn_dim,
    "num_hidden_layers": config.num_layers,
    "num_attention_heads": config.num_heads,
    "num_key_value_heads": config.num_kv_heads,
    "head_dim": config.head_dim,
    "hidden_act": "silu",
    "rms_norm_eps": config.norm_eps,
    "rope_theta": config.rope_theta,
    "rope_scaling": None,
    "tie_word_embeddings": config.tie_embeddings,
    "torch_dtype": torch_dtype,
  }
  scaling = config.rope_scaling
  if scaling is not None:
    # transformers 5 writes rope_parameters (with rope_theta); 4.x reads rope_scaling; both agree.
    fields = {
      f.name: getattr(scaling, f.name)
      for f in dataclasses.fields(scaling)
      if getattr(scaling, f.name) is not None
    }
    hf["rope_scaling"] = fields
    hf["rope_parameters"] = dict(fields, rope_theta=config.rope_theta)
    if scaling.original_max_position_embeddings is not None:
      # Only transformers' consistency checks read it (yarn: factor = this / the original).
      hf["max_position_embeddings"] = round(
        scaling.original_max_position_embeddings * scaling.factor
      )
  if family == "qwen2":
    hf["use_sliding_window"] = False
  else:
    hf["attention_bias"] = False
    hf["use_sliding_window" if family == "qwen3" else "mlp_bias"] = False
  return hf
