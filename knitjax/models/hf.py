"""Hugging Face checkpoints of the Qwen2 / Qwen2.5 / Qwen3 / Llama-3 family <-> knitjax's decoder.

`load_hf_params` reads `model.safetensors` (or the shards of `model.safetensors.index.json`) into
the NNX param tree, one tensor at a time, placing each with the sharding of `knitjax.sharding`'s
rules; `save_hf_params` writes the inverse, for tests and for exporting a trained policy; and
`init_from_hf` builds a policy straight from a checkpoint folder. `load_entries`, `save_items` and
`write_folder` are the same steps on a decoder held inside a bigger checkpoint (LLaVA's
`language_model`, see `knitjax.models.hf_vision`).

`config.json` <-> `TransformerConfig` lives in `knitjax.models.hf_config`; `config_from_hf`,
`config_to_hf` and `CONFIG_FILE` are re-exported here, so `hf.config_from_hf(path)` works. The
safetensors files themselves are read and written by `knitjax.models.safetensors_io` (NumPy and
`ml_dtypes`, no extra dependency); this module maps Hugging Face's tensor names and axes onto
knitjax's.
"""

import dataclasses
import json
import math
import os

import jax
import numpy as np
from flax import nnx

from knitjax import sharding as sharding_lib
from knitjax.models import lora
from knitjax.models.hf_config import (
  CONFIG_FILE,
  _read_json,
  check_model_fits,
  config_from_hf,
  config_to_hf,
  host_memory_bytes,
)
from knitjax.models.safetensors_io import (
  DTYPE_NAMES,
  Entry,
  read_header,
  read_tensor,
  write_streamed,
)
from knitjax.models.transformer import EXECUTION_FIELDS, Transformer, TransformerConfig

__all__ = [
  "CONFIG_FILE",
  "INDEX_FILE",
  "WEIGHTS_FILE",
  "config_from_hf",
  "config_to_hf",
  "init_from_hf",
  "checkpoint_entries",
  "load_entries",
  "load_hf_params",
  "read_safetensors",
  "save_hf_params",
  "save_items",
  "write_folder",
]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_TORCH_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def checkpoint_entries(path: str) -> dict[str, Entry]:
  """Every tensor of a checkpoint folder (single file or index.json shards), by name."""
  index = os.path.join(path, INDEX_FILE)
  if os.path.isfile(index):
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
      got = "no weight_map" if weight_map is None else f"weight_map {json.dumps(weight_map):.60}"
      raise ValueError(f"{index} has {got}; accepted: an object of tensor name -> shard file.")
    for name, shard in weight_map.items():
      if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard:
        raise ValueError(
          f"{index} maps tensor {name!r} to {shard!r:.60}; accepted: a file name in {path}."
        )
    entries: dict[str, Entry] = {}
    for shard in sorted(set(weight_map.values())):
      for name, entry in read_header(os.path.join(path, shard)).items():
        if name in entries:
          raise ValueError(f"tensor {name!r} appears in two shards of {path}.")
        entries[name] = entry
    for name, shard in weight_map.items():
      if name not in entries or os.path.basename(entries[name].file) != shard:
        raise ValueError(f"{index} maps tensor {name!r} to {shard}, which does not hold it.")
    return entries
  single = path if path.endswith(".safetensors") else os.path.join(path, WEIGHTS_FILE)
  if not os.path.isfile(single):
    raise ValueError(f"{path} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}.")
  return read_header(single)


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """All tensors of a checkpoint folder or `.safetensors` file, in their stored dtypes."""
  return {name: read_tensor(e) for name, e in checkpoint_entries(os.fspath(path)).items()}


@dataclasses.dataclass(frozen=True)
class _Slot:
  """Where a knitjax param lives in the checkpoint.

  `split` > 0: a Linear weight; knitjax's kernel is [in..., out...] with `split` input axes and
  Hugging Face's is [prod(out), prod(in)]. `split` = 0: the same values, maybe flattened (biases).
  """

  name: str
  split: int = 0

  def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    if self.split:
      return (math.prod(shape[self.split :]), math.prod(shape[: self.split]))
    return (math.prod(shape),) if self.name.endswith(".bias") else tuple(shape)

  def to_knitjax(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return (hf.T if self.split else hf).reshape(shape)

  def to_hf(self, value: np.ndarray) -> np.ndarray:
    if self.split:
      return value.reshape(math.prod(value.shape[: self.split]), -1).T
    return value.reshape(self.hf_shape(value.shape))


_TOP = {
  ("embedder", "embedding"): _Slot("model.embed_tokens.weight"),
  ("final_norm", "scale"): _Slot("model.norm.weight"),
  ("lm_head",): _Slot("lm_head.weight", 1),
}
_BLOCK = {
  ("attn_norm", "scale"): _Slot("input_layernorm.weight"),
  ("mlp_norm", "scale"): _Slot("post_attention_layernorm.weight"),
  ("attn", "q_kernel"): _Slot("self_attn.q_proj.weight", 1),
  ("attn", "k_kernel"): _Slot("self_attn.k_proj.weight", 1),
  ("attn", "v_kernel"): _Slot("self_attn.v_proj.weight", 1),
  ("attn", "o_kernel"): _Slot("self_attn.o_proj.weight", 2),
  ("attn", "q_bias"): _Slot("self_attn.q_proj.bias"),
  ("attn", "k_bias"): _Slot("self_attn.k_proj.bias"),
  ("attn", "v_bias"): _Slot("self_attn.v_proj.bias"),
  ("attn", "q_norm", "scale"): _Slot("self_attn.q_norm.weight"),
  ("attn", "k_norm", "scale"): _Slot("self_attn.k_norm.weight"),
  ("mlp", "gate_kernel"): _Slot("mlp.gate_proj.weight", 1),
  ("mlp", "up_kernel"): _Slot("mlp.up_proj.weight", 1),
  ("mlp", "down_kernel"): _Slot("mlp.down_proj.weight", 1),
}


def _slot(path: tuple) -> _Slot:
  path = tuple(int(p) if isinstance(p, int | np.integer) else str(p) for p in path)
  if path in _TOP:
    return _TOP[path]
  if len(path) > 2 and path[0] == "blocks" and isinstance(path[1], int) and path[2:] in _BLOCK:
    slot = _BLOCK[path[2:]]
    return dataclasses.replace(slot, name=f"model.layers.{path[1]}.{slot.name}")
  raise ValueError(f"param {'/'.join(map(str, path))} has no Hugging Face counterpart.")


def _split_state(model_or_state) -> tuple[nnx.State, TransformerConfig | None]:
  if isinstance(model_or_state, nnx.Module):
    config = getattr(model_or_state, "config", None)
    return nnx.state(model_or_state), config if isinstance(config, TransformerConfig) else None
  return model_or_state, None


def _value(variable):
  return variable.get_value() if isinstance(variable, nnx.Variable) else variable


def _check_config(path: str, config: TransformerConfig) -> None:
  if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
    return
  # How the model runs (dtype, attention kernel, remat, layer scan) and its LoRA adapters are
  # the run's choice; the folder fixes the rest.
  chosen = {f: getattr(config, f) for f in (*EXECUTION_FIELDS, *lora.CONFIG_FIELDS)}
  want = dataclasses.replace(config_from_hf(path), **chosen)
  for field in dataclasses.fields(TransformerConfig):
    got, expected = getattr(config, field.name), getattr(want, field.name)
    if got != expected:
      raise ValueError(
        f"the model has {field.name}={got!r} but {path}/{CONFIG_FILE} says {expected!r}; build "
        "the model from config_from_hf(path)."
      )


def _sharding(variable, shape, mesh):
  if mesh is not None:
    axes = (
      variable.get_metadata().get("out_sharding") if isinstance(variable, nnx.Variable) else None
    )
    if axes is None:
      return sharding_lib.replicated(mesh)
    return sharding_lib.logical_sharding(mesh, tuple(axes), shape)
  current = getattr(_value(variable), "sharding", None)
  return current if isinstance(current, jax.sharding.Sharding) else None


def _place(array: np.ndarray, sharding) -> jax.Array:
  if sharding is None:
    return jax.device_put(np.ascontiguousarray(array))
  # Each process copies out only its own shards (of a maybe transposed view) from host memory.
  return jax.make_array_from_callback(
    array.shape, sharding, lambda index: np.ascontiguousarray(array[index])
  )


def load_hf_params(
  path: str | os.PathLike,
  model_or_abstract_state,
  *,
  mesh: jax.sharding.Mesh | None = None,
  dtype=np.float32,
) -> nnx.State:
  """Reads a Hugging Face checkpoint into knitjax's param tree.

  Every name and shape is checked against the headers before any data is read; then tensors are
  read, converted and placed one at a time, so host memory holds about one tensor (in its stored
  and its loaded dtype) at once, never the whole model.

  Args:
    path: checkpoint folder (`model.safetensors` or `model.safetensors.index.json` + shards).
    model_or_abstract_state: a `Transformer` (updated in place and checked against the folder's
      `config.json`), or its state, concrete or abstract (`nnx.split(nnx.eval_shape(...))[1]`).
    mesh: when given, each param gets the NamedSharding of `knitjax.sharding`'s rules; otherwise
      the sharding of the given concrete param, or the default device.
    dtype: the dtype params are converted to (knitjax keeps float32 params).

  Returns:
    The loaded state, with the structure and metadata of the given one.

  Raises:
    ValueError: naming the first missing, misshapen or unused tensor.
  """
  path = os.fspath(path)
  state, config = _split_state(model_or_abstract_state)
  if config is not None:
    _check_config(path, config)
  new_state = load_entries(checkpoint_entries(path), state, where=path, mesh=mesh, dtype=dtype)
  if isinstance(model_or_abstract_state, nnx.Module):
    nnx.update(model_or_abstract_state, new_state)
  return new_state


def load_entries(
  entries: dict[str, Entry],
  state: nnx.State,
  *,
  where: str,
  mesh: jax.sharding.Mesh | None = None,
  dtype=np.float32,
) -> nnx.State:
  """`load_hf_params` on tensor headers already read, named as in a text-only checkpoint.

  Composite checkpoints (LLaVA) hold the decoder under another prefix: they pass its tensors
  renamed to `model.*` / `lm_head.weight`. `where` names the checkpoint in errors.
  """
  plan, used = [], set()
  for key, variable in nnx.to_flat_state(state):
    slot, shape = _slot(key), tuple(_value(variable).shape)
    entry = entries.get(slot.name)
    if entry is None:
      raise ValueError(f"{where} lacks tensor {slot.name!r} that the model needs (shape {shape}).")
    if entry.shape != slot.hf_shape(shape):
      raise ValueError(
        f"tensor {slot.name!r} in {where} has shape {entry.shape} but the model needs "
        f"{slot.hf_shape(shape)}."
      )
    plan.append((key, variable, slot, shape))
    used.add(slot.name)
  tied_head = "lm_head.weight" in entries and "lm_head.weight" not in used
  for name in entries:
    if name in used or (tied_head and name == "lm_head.weight"):
      continue
    if not name.endswith(".rotary_emb.inv_freq"):  # a non-persistent buffer some exports keep
      raise ValueError(f"tensor {name!r} in {where} is not used by the model.")
  if tied_head:  # some exports keep the tied head; accept only an exact copy of the embedding
    embed = entries.get("model.embed_tokens.weight")
    same = embed is not None and np.array_equal(
      read_tensor(entries["lm_head.weight"]), read_tensor(embed)
    )
    if not same:
      raise ValueError(
        f"tensor 'lm_head.weight' in {where} differs from the embedding, but the model ties them; "
        "set tie_embeddings=False (tie_word_embeddings=false)."
      )
  loaded = []
  for key, variable, slot, shape in plan:
    hf = read_tensor(entries[slot.name]).astype(dtype, copy=False)
    value = _place(slot.to_knitjax(hf, shape), _sharding(variable, shape, mesh))
    loaded.append((key, variable.replace(value) if isinstance(variable, nnx.Variable) else value))
  return nnx.from_flat_state(loaded)


def _host(value, dtype) -> np.ndarray:
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    from jax.experimental import multihost_utils

    value = multihost_utils.process_allgather(value, tiled=True)
  return np.asarray(jax.device_get(value)).astype(dtype, copy=False)


def save_hf_params(
  model_or_state,
  config: TransformerConfig,
  path: str | os.PathLike,
  *,
  dtype=np.float32,
  max_shard_bytes: int | None = None,
) -> None:
  """Writes `config.json` and the weights in Hugging Face's names and axes (inverse of
  `load_hf_params`).

  Args:
    model_or_state: a `Transformer` or its (concrete) state.
    config: its config (gives the family: qk_norm -> qwen3, qkv_bias -> qwen2, else llama).
    path: folder to write (created if missing).
    dtype: stored dtype, e.g. `np.float32` or `ml_dtypes.bfloat16`.
    max_shard_bytes: when set, shards of at most this size (a single tensor may exceed it) and a
      `model.safetensors.index.json`, as `save_pretrained` writes for big models.

  Tensors are fetched to the host one at a time while writing. In a multi-process run every
  process must call this (params are gathered); only process 0 writes. LoRA adapters are merged
  into their kernels first (``W + (alpha / r)·A·B``, `lora.merged`): the folder holds the plain
  model, which loads without LoRA.
  """
  dtype = _save_dtype(dtype)
  items = save_items(lora.merged(_split_state(model_or_state)[0]), dtype)
  hf_config = config_to_hf(config, torch_dtype=_TORCH_DTYPES[DTYPE_NAMES[dtype]])
  write_folder(path, items, hf_config, dtype=dtype, max_shard_bytes=max_shard_bytes)


def _save_dtype(dtype) -> np.dtype:
  dtype = np.dtype(dtype)
  if dtype not in DTYPE_NAMES:
    raise ValueError(f"save_hf_params dtype {dtype} is not supported; accepted: float32, bfloat16.")
  return dtype


def save_items(state: nnx.State, dtype: np.dtype, rename=None) -> list[tuple]:
  """`(name, hf shape, dtype, fetch)` per param of a decoder state, for `write_folder`.

  `rename` maps the text-only name (`model.*`, `lm_head.weight`) to the one written.
  """
  items = []
  for key, variable in nnx.to_flat_state(state):
    if key[0] == "value_head":  # PPO's critic head: a causal LM checkpoint has no place for it
      continue
    value, slot = _value(variable), _slot(key)
    fetch = lambda value=value, slot=slot: slot.to_hf(_host(value, dtype))
    name = slot.name if rename is None else rename(slot.name)
    items.append((name, slot.hf_shape(tuple(value.shape)), dtype, fetch))
  return items


def write_folder(
  path: str | os.PathLike,
  items: list[tuple],
  hf_config: dict,
  *,
  dtype: np.dtype,
  max_shard_bytes: int | None = None,
) -> None:
  """Writes `config.json` and the `(name, shape, dtype, fetch)` items as `save_pretrained` does."""
  path = os.fspath(path)
  items = sorted(items, key=lambda item: item[0])
  shards, size = [[]], 0
  for item in items:
    nbytes = math.prod(item[1]) * dtype.itemsize
    if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(item)
    size += nbytes
  if max_shard_bytes is None:
    files = [WEIGHTS_FILE]
  else:
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  if jax.process_index() != 0:  # take part in the gathers of non-addressable params, in order
    for *_, fetch in items:
      fetch()
    return
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2)
  for file, shard in zip(files, shards, strict=True):
    write_streamed(os.path.join(path, file), shard)
  if max_shard_bytes is not None:
    index = {
      "metadata": {"total_size": sum(math.prod(i[1]) * dtype.itemsize for i in items)},
      "weight_map": {
        item[0]: file for file, shard in zip(files, shards, strict=True) for item in shard
      },
    }
    with open(os.path.join(path, INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2)


def check_fits_devices(config: TransformerConfig, where: str, mesh) -> None:
  """Before tracing: the float32 params must fit the devices they go to, together (GPUs and TPUs
  report their memory), or this host's memory (CPU devices share it)."""
  devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
  # only this process's devices report their memory; the others of the mesh are taken as alike
  local = [d for d in devices if d.process_index == jax.process_index()]
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in local]
  if local and all(limits):
    what = f"memory of the {len(devices)} {devices[0].platform} device(s)"
    check_model_fits(config, where, sum(limits) * len(devices) // len(local), what)
  else:
    check_model_fits(config, where, host_memory_bytes(), "memory of this host")


def init_from_hf(
  path: str | os.PathLike,
  mesh: jax.sharding.Mesh | None = None,
  *,
  dtype: str = "float32",
  config: TransformerConfig | None = None,
  seed: int = 0,
):
  """`(config, graphdef, state)` of a Transformer loaded from a checkpoint folder, no random init.

  The drop-in for `sharding.init_sharded` when the policy starts from a Hugging Face checkpoint:
  the model is only traced (`nnx.eval_shape`), then each param is read and placed on `mesh`.
  `config` (default: the folder's, in `dtype`) may add LoRA adapters (`lora_rank` > 0): the
  checkpoint is then the base, and the adapters start fresh (drawn from `seed`, B = 0).
  """
  path = os.fspath(path)
  if config is None:
    config = config_from_hf(path, dtype=dtype)
  else:
    _check_config(path, config)
  check_fits_devices(config, os.path.join(path, CONFIG_FILE), mesh)
  make = lambda: Transformer(config, rngs=nnx.Rngs(seed))  # noqa: E731
  graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
  if config.lora is None:
    return config, graphdef, load_hf_params(path, abstract_state, mesh=mesh)
  base = load_hf_params(path, lora.split(abstract_state)[1], mesh=mesh)
  return config, graphdef, lora.combine(base, lora.init_adapters(make, mesh))
