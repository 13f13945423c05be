"""Hugging Face SigLIP and LLaVA checkpoints <-> knitjax's `VisionEncoder` and `VLM`.

SigLIP towers alone live in `knitjax.models.hf_siglip` (re-exported here). This module reads and
writes `LlavaForConditionalGeneration` folders whose vision tower is SigLIP and whose text model
is one `knitjax.models.hf` loads (Qwen2 / Qwen3 / Llama): `llava_config_from_hf` maps config.json
(`vision_feature_layer`, `vision_feature_select_strategy`, `projector_hidden_act`,
`image_token_index`) onto `VisionConfig` / `TransformerConfig`, `load_llava_params` reads the
weights, `init_vlm_from_hf` builds a sharded VLM straight from a folder, and `save_llava` exports.

Tensor namings, by prefix (the names under them are SigLIP's, the decoder's, the projector's):

- "v5" (transformers 5.x in memory, `save_pretrained(save_original_format=False)`):
  `model.vision_tower.`, `model.multi_modal_projector.`, `model.language_model.`, `lm_head.weight`;
- "v4" (transformers 4.x): `vision_tower.vision_model.`, `multi_modal_projector.`,
  `language_model.model.`, `language_model.lm_head.weight`.

The loader finds the naming from the names present, and also reads what transformers 5.x's
`save_pretrained` writes by default (the v4 names, but `vision_tower.` without `vision_model.`).
"""

import dataclasses
import os
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx

from knitjax.models import hf
from knitjax.models.hf_config import CONFIG_FILE, config_from_hf, config_to_hf
from knitjax.models.hf_siglip import (
  KNITJAX_ACTS,
  _config_dict,
  dense_tensors,
  detect_prefix,
  hf_act,
  load_mapped,
  load_siglip_params,
  mapped_items,
  save_siglip,
  siglip_config_from_hf,
  siglip_config_to_hf,
  vision_tensors,
)
from knitjax.models.safetensors_io import DTYPE_NAMES, Entry
from knitjax.models.transformer import TransformerConfig
from knitjax.models.vision import VisionConfig
from knitjax.models.vlm import VLM

__all__ = [
  "LLAVA_NAMINGS",
  "init_vlm_from_hf",
  "is_llava",
  "llava_config_from_hf",
  "llava_config_to_hf",
  "load_llava_params",
  "load_siglip_params",
  "save_llava",
  "save_siglip",
  "siglip_config_from_hf",
  "siglip_config_to_hf",
]


@dataclasses.dataclass(frozen=True)
class _Naming:
  vision: str
  projector: str
  text: str  # replaces the decoder's "model." prefix
  head: str  # the name of lm_head.weight

  def text_name(self, name: str) -> str:
    """A text-only checkpoint name (`model.*`, `lm_head.weight`) -> its name in this naming."""
    return self.head if name == "lm_head.weight" else self.text + name.removeprefix("model.")


LLAVA_NAMINGS = {
  "v5": _Naming(
    "model.vision_tower.", "model.multi_modal_projector.", "model.language_model.", "lm_head.weight"
  ),
  "v4": _Naming(
    "vision_tower.vision_model.",
    "multi_modal_projector.",
    "language_model.model.",
    "language_model.lm_head.weight",
  ),
}
_VISION_PREFIXES = (
  "model.vision_tower.vision_model.",
  "model.vision_tower.",
  "vision_tower.vision_model.",
  "vision_tower.",
)
_STRATEGIES = {"default": True, "full": False}  # -> drop_first_token


def is_llava(path: str | os.PathLike) -> bool:
  """Whether the folder's config.json is a LLaVA model (`model_type: llava`)."""
  config = os.path.join(os.fspath(path), CONFIG_FILE)
  return os.path.isfile(config) and _config_dict(config).get("model_type") == "llava"


def llava_config_from_hf(
  path_or_dict, *, dtype: str = "float32"
) -> tuple[TransformerConfig, VisionConfig, int]:
  """`(lm_config, vision_config, image_token_id)` of a LLaVA config.json (folder, path or dict).

  Raises:
    ValueError: one sentence naming the field, for a tower other than SigLIP, a text model
      `knitjax.models.hf` does not load, an unknown strategy or activation, or a projector
      without biases.
  """
  c = _config_dict(path_or_dict)
  if c.get("model_type") != "llava":
    raise ValueError(f"config.json model_type={c.get('model_type')!r} is not 'llava'.")
  token = c.get("image_token_index", c.get("image_token_id", 32000))
  if isinstance(token, bool) or not isinstance(token, int) or token < 0:
    raise ValueError(f"config.json image_token_index must be a token id >= 0, got {token!r}.")
  layer = c.get("vision_feature_layer", -2)
  layers = [layer] if isinstance(layer, int) and not isinstance(layer, bool) else layer
  if (
    not isinstance(layers, list)
    or not layers
    or any(isinstance(i, bool) or not isinstance(i, int) for i in layers)
  ):
    raise ValueError(
      f"config.json vision_feature_layer must be an integer or a list of them, got {layer!r}."
    )
  strategy = c.get("vision_feature_select_strategy", "default")
  if strategy not in _STRATEGIES:
    raise ValueError(
      f"config.json vision_feature_select_strategy={strategy!r} is not supported; accepted: "
      f"{sorted(_STRATEGIES)}."
    )
  if c.get("multimodal_projector_bias", True) is not True:
    raise ValueError("config.json multimodal_projector_bias must be true; accepted: true.")
  text = c.get("text_config")
  if not isinstance(text, Mapping):
    raise ValueError(f"config.json text_config must be an object, got {text!r:.60}.")
  # LlavaConfig ties the head if either its own flag or the text config's says so.
  tie = bool(c.get("tie_word_embeddings")) or bool(text.get("tie_word_embeddings"))
  lm_config = config_from_hf(
    {"model_type": "llama", **text, "tie_word_embeddings": tie}, dtype=dtype
  )
  vision = c.get("vision_config")
  if not isinstance(vision, Mapping):
    raise ValueError(f"config.json vision_config must be an object, got {vision!r:.60}.")
  vision_config = siglip_config_from_hf(
    vision,
    dtype=dtype,
    where="config.json vision_config",
    feature_layers=tuple(layers),
    drop_first_token=_STRATEGIES[strategy],
    projector_dim=lm_config.d_model,
    projector_act=hf_act(
      c.get("projector_hidden_act", "gelu"), "projector_hidden_act", "config.json"
    ),
  )
  return lm_config, vision_config, token


def llava_config_to_hf(
  lm_config: TransformerConfig, vision_config: VisionConfig, image_token_id: int
) -> dict:
  """The LLaVA config.json dict of a knitjax VLM (inverse of `llava_config_from_hf`)."""
  if not vision_config.feature_layers:
    raise ValueError(
      "VisionConfig.feature_layers is empty (features after the final LayerNorm), which LLaVA "
      "cannot express; accepted: hidden-state indices, e.g. (-2,)."
    )
  if vision_config.projector_dim != lm_config.d_model:
    raise ValueError(
      f"VisionConfig.projector_dim={vision_config.projector_dim} must equal the decoder's d_model="
      f"{lm_config.d_model} in LLaVA."
    )
  layers = vision_config.feature_layers
  text = {
    k: v for k, v in config_to_hf(lm_config).items() if k not in ("architectures", "torch_dtype")
  }
  return {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "image_token_index": image_token_id,
    "image_seq_length": vision_config.num_image_tokens,
    "projector_hidden_act": KNITJAX_ACTS[vision_config.projector_act],
    "multimodal_projector_bias": True,
    "vision_feature_layer": layers[0] if len(layers) == 1 else list(layers),
    "vision_feature_select_strategy": "default" if vision_config.drop_first_token else "full",
    "tie_word_embeddings": lm_config.tie_embeddings,
    "text_config": text,
    "vision_config": siglip_config_to_hf(vision_config),
  }


def _projector_tensors(vision_config: VisionConfig, d_out: int, prefix: str) -> dict:
  hidden = vision_config.projector_dim
  t = dense_tensors(("fc1",), "linear_1", vision_config.feature_dim, hidden)
  t |= dense_tensors(("fc2",), "linear_2", hidden, d_out)
  return {path: dataclasses.replace(x, name=prefix + x.name) for path, x in t.items()}


def _partition(entries: Mapping[str, Entry], where: str):
  """(vision prefix, naming of the rest, {part: entries}) of a LLaVA checkpoint's tensors."""
  vision_prefix = detect_prefix(entries, _VISION_PREFIXES, where)
  naming = LLAVA_NAMINGS["v5" if vision_prefix.startswith("model.") else "v4"]
  parts = {"vision": {}, "projector": {}, "lm": {}}
  text_names = {}
  for name, entry in entries.items():
    if name.startswith(vision_prefix):
      parts["vision"][name] = entry
    elif name.startswith(naming.projector):
      parts["projector"][name] = entry
    elif name == naming.head:
      text_names["lm_head.weight"] = entry
    elif name.startswith(naming.text):
      text_names["model." + name.removeprefix(naming.text)] = entry
    else:
      raise ValueError(f"tensor {name!r} in {where} is not part of a LLaVA model's naming.")
  parts["lm"] = text_names
  return vision_prefix, naming, parts


def load_llava_params(
  path: str | os.PathLike,
  vlm_or_state,
  mesh: jax.sharding.Mesh | None = None,
  *,
  dtype=np.float32,
) -> nnx.State:
  """Reads a LLaVA folder (any naming above) into a VLM's params.

  Args:
    path: checkpoint folder.
    vlm_or_state: a `VLM` (updated in place) or its state, concrete or abstract, built from
      `llava_config_from_hf(path)`.
    mesh: when given, params get the NamedSharding of `knitjax.sharding`'s rules.
    dtype: the param dtype.
  """
  path = os.fspath(path)
  lm_config, vision_config, _ = llava_config_from_hf(path)
  state = nnx.state(vlm_or_state) if isinstance(vlm_or_state, nnx.Module) else vlm_or_state
  vision_prefix, naming, parts = _partition(hf.checkpoint_entries(path), path)
  kw = dict(where=path, mesh=mesh, dtype=dtype)
  vision_table = vision_tensors(vision_config, vision_prefix)
  projector_table = _projector_tensors(vision_config, lm_config.d_model, naming.projector)
  parts_state = nnx.State(
    {
      "vision": load_mapped(parts["vision"], state["vision"], vision_table, **kw),
      "projector": load_mapped(parts["projector"], state["projector"], projector_table, **kw),
      "lm": hf.load_entries(parts["lm"], state["lm"], **kw),
    }
  )
  # One State nested as nnx.split nests it (a State per part would not match an optimizer state).
  new_state = nnx.from_flat_state(nnx.to_flat_state(parts_state))
  if isinstance(vlm_or_state, nnx.Module):
    nnx.update(vlm_or_state, new_state)
  return new_state


def init_vlm_from_hf(
  path: str | os.PathLike, mesh: jax.sharding.Mesh | None = None, *, dtype: str = "float32"
):
  """`(lm_config, vision_config, image_token_id, graphdef, params)` of a VLM read from a LLaVA
  folder, without a random init: the model is only traced, then each param is read and placed on
  `mesh` (as `hf.init_from_hf` does for a decoder)."""
  lm_config, vision_config, token = llava_config_from_hf(path, dtype=dtype)
  abstract = nnx.eval_shape(
    lambda: VLM(lm_config, vision_config, image_token_id=token, rngs=nnx.Rngs(0))
  )
  graphdef, abstract_state = nnx.split(abstract)
  params = load_llava_params(path, abstract_state, mesh)
  return lm_config, vision_config, token, graphdef, params


def save_llava(
  vlm_or_state,
  lm_config: TransformerConfig,
  vision_config: VisionConfig,
  image_token_id: int,
  path: str | os.PathLike,
  *,
  naming: str = "v5",
  dtype=np.float32,
  max_shard_bytes: int | None = None,
) -> None:
  """Writes a VLM as a `LlavaForConditionalGeneration` folder that transformers loads.

  `naming`: "v5" or "v4" (table above). In a multi-process run every process must call this.
  """
  if naming not in LLAVA_NAMINGS:
    raise ValueError(f"save_llava naming={naming!r} is unknown; accepted: {sorted(LLAVA_NAMINGS)}.")
  names = LLAVA_NAMINGS[naming]
  dtype = hf._save_dtype(dtype)
  hf_config = llava_config_to_hf(lm_config, vision_config, image_token_id)
  state = nnx.state(vlm_or_state) if isinstance(vlm_or_state, nnx.Module) else vlm_or_state
  projector_table = _projector_tensors(vision_config, lm_config.d_model, names.projector)
  items = mapped_items(state["vision"], vision_tensors(vision_config, names.vision), dtype)
  items += mapped_items(state["projector"], projector_table, dtype)
  items += hf.save_items(state["lm"], dtype, rename=names.text_name)
  hf_config["torch_dtype"] = hf._TORCH_DTYPES[DTYPE_NAMES[dtype]]
  hf.write_folder(path, items, hf_config, dtype=dtype, max_shard_bytes=max_shard_bytes)
