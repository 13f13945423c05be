"""Hugging Face SigLIP vision towers (`SiglipVisionModel`) <-> knitjax's `VisionEncoder`.

`siglip_config_from_hf` turns a `siglip_vision_model` config into a `VisionConfig`;
`vision_tensors` lists, per encoder param, the Hugging Face tensor it comes from and how its axes
changes; `load_mapped` / `mapped_items` read and write such tables (one tensor at a time, placed
with `knitjax.sharding`'s rules, as `knitjax.models.hf` does for the decoder). `load_siglip_params`
and `save_siglip` are the standalone-tower entry points; `knitjax.models.hf_vision` reuses the
table under LLaVA's `vision_tower.` prefix.

Layouts: transformers 5.x writes `embeddings.*`, `encoder.layers.*`, `post_layernorm.*`, `head.*`;
4.x wrote the same under `vision_model.`. The patch convolution's weight `[D, C, p, p]` becomes
knitjax's `[p * p * C, D]` in `patchify`'s (row, column, channel) order; Linear weights `[out, in]`
become `[in, out]` kernels with the head axes split out; the pooling head's
`nn.MultiheadAttention.in_proj_weight` `[3D, D]` holds the q, k and v kernels, in that order.
"""

import dataclasses
import math
import os
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx

from knitjax.models import hf
from knitjax.models.hf_config import CONFIG_FILE, _read_json
from knitjax.models.safetensors_io import DTYPE_NAMES, Entry, read_tensor
from knitjax.models.vision import VisionConfig

SIGLIP_TYPE = "siglip_vision_model"
# Hugging Face hidden_act -> knitjax activation ("gelu_new" is the same tanh formula).
HF_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}
KNITJAX_ACTS = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}
SIGLIP_NAMINGS = {"v5": "", "v4": "vision_model."}
# SiglipVisionConfig's defaults, for fields a config.json leaves out.
_DEFAULTS = dict(
  hidden_size=768,
  intermediate_size=3072,
  num_hidden_layers=12,
  num_attention_heads=12,
  num_channels=3,
  image_size=224,
  patch_size=16,
  hidden_act="gelu_pytorch_tanh",
  layer_norm_eps=1e-6,
  vision_use_head=True,
)


def _int(hf: Mapping, key: str, where: str) -> int:
  value = hf.get(key, _DEFAULTS[key])
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{where} {key} must be a positive integer, got {value!r}.")
  return value


def hf_act(value, key: str, where: str) -> str:
  """knitjax's name for a Hugging Face GELU activation; any other is one ValueError."""
  if value not in HF_ACTS:
    raise ValueError(f"{where} {key}={value!r} is not supported; accepted: {sorted(HF_ACTS)}.")
  return HF_ACTS[value]


def _config_dict(path_or_dict) -> dict:
  if isinstance(path_or_dict, Mapping):
    return dict(path_or_dict)
  path = os.fspath(path_or_dict)
  return _read_json(os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path)


def siglip_config_from_hf(
  path_or_dict, *, dtype: str = "float32", where: str = "config.json", **overrides
) -> VisionConfig:
  """The `VisionConfig` of a SigLIP vision config (a folder, its config.json, or the dict).

  A full `siglip` config (text and vision) gives its `vision_config`. `overrides` set VisionConfig
  fields the tower's config does not hold (LLaVA's feature layers, projector).

  Raises:
    ValueError: one sentence naming the field, for another model type, an activation other than
      GELU, a width not divisible by the heads, or a field of the wrong type.
  """
  c = _config_dict(path_or_dict)
  if c.get("model_type") == "siglip" and isinstance(c.get("vision_config"), Mapping):
    c = dict(c["vision_config"])
  if c.get("model_type", SIGLIP_TYPE) != SIGLIP_TYPE:
    raise ValueError(
      f"{where} model_type={c.get('model_type')!r} is not a SigLIP vision tower; accepted: "
      f"{SIGLIP_TYPE!r} (CLIP towers are not supported)."
    )
  d, heads = _int(c, "hidden_size", where), _int(c, "num_attention_heads", where)
  if d % heads:
    raise ValueError(f"{where} hidden_size={d} must be a multiple of num_attention_heads={heads}.")
  eps = c.get("layer_norm_eps", _DEFAULTS["layer_norm_eps"])
  if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1:
    raise ValueError(f"{where} layer_norm_eps must be a number in (0, 1), got {eps!r}.")
  use_head = c.get("vision_use_head", _DEFAULTS["vision_use_head"])
  if not isinstance(use_head, bool):
    raise ValueError(f"{where} vision_use_head must be true or false, got {use_head!r}.")
  fields = dict(
    image_size=_int(c, "image_size", where),
    patch_size=_int(c, "patch_size", where),
    channels=_int(c, "num_channels", where),
    d_model=d,
    num_layers=_int(c, "num_hidden_layers", where),
    num_heads=heads,
    head_dim=d // heads,
    mlp_dim=_int(c, "intermediate_size", where),
    norm_eps=float(eps),
    mlp_act=hf_act(c.get("hidden_act", _DEFAULTS["hidden_act"]), "hidden_act", where),
    pool_head=use_head,
    dtype=dtype,
  )
  return VisionConfig(**{**fields, **overrides})


def siglip_config_to_hf(config: VisionConfig) -> dict:
  """The `siglip_vision_model` config dict of a VisionConfig (inverse of siglip_config_from_hf)."""
  if config.head_dim * config.num_heads != config.d_model:
    raise ValueError(
      f"VisionConfig head_dim={config.head_dim} x num_heads={config.num_heads} must equal d_model="
      f"{config.d_model} for a SigLIP export."
    )
  return {
    "architectures": ["SiglipVisionModel"],
    "model_type": SIGLIP_TYPE,
    "hidden_size": config.d_model,
    "intermediate_size": config.mlp_dim,
    "num_hidden_layers": config.num_layers,
    "num_attention_heads": config.num_heads,
    "num_channels": config.channels,
    "image_size": config.image_size,
    "patch_size": config.patch_size,
    "hidden_act": KNITJAX_ACTS[config.mlp_act],
    "layer_norm_eps": config.norm_eps,
    "attention_dropout": 0.0,
    "vision_use_head": config.pool_head,
  }


@dataclasses.dataclass(frozen=True)
class Tensor:
  """Where one knitjax param lives in a checkpoint.

  `kind`: "linear" (HF [out, in] <-> knitjax [in..., out...] with `split` input axes), "patch"
  (conv [D, C, p, p] <-> [p * p * C, D]) or "same" (a reshape). `part` = (i, k): the param is the
  i-th of k equal row blocks of the tensor (in_proj_weight / in_proj_bias).
  """

  name: str
  hf_shape: tuple[int, ...]
  kind: str = "same"
  split: int = 1
  part: tuple[int, int] = (0, 1)

  @property
  def piece_shape(self) -> tuple[int, ...]:
    return (self.hf_shape[0] // self.part[1], *self.hf_shape[1:])

  def to_knitjax(self, hf_array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    rows = self.hf_shape[0] // self.part[1]
    x = hf_array[self.part[0] * rows : (self.part[0] + 1) * rows]
    if self.kind == "linear":
      return x.T.reshape(shape)
    if self.kind == "patch":
      return x.transpose(2, 3, 1, 0).reshape(shape)
    return x.reshape(shape)

  def to_hf(self, value: np.ndarray) -> np.ndarray:
    if self.kind == "linear":
      return value.reshape(math.prod(value.shape[: self.split]), -1).T
    if self.kind == "patch":
      d, c, p, _ = self.hf_shape
      return value.reshape(p, p, c, d).transpose(3, 2, 0, 1)
    return value.reshape(self.piece_shape)


def _linear(name: str, d_out: int, d_in: int, split: int = 1) -> Tensor:
  return Tensor(f"{name}.weight", (d_out, d_in), "linear", split)


def dense_tensors(path: tuple, name: str, d_in: int, d_out: int) -> dict[tuple, Tensor]:
  """A knitjax `Dense` (kernel, bias) <-> an `nn.Linear` (weight, bias)."""
  return {
    (*path, "kernel"): _linear(name, d_out, d_in),
    (*path, "bias"): Tensor(f"{name}.bias", (d_out,)),
  }


def _norm(path: tuple, name: str, d: int) -> dict[tuple, Tensor]:
  return {
    (*path, "scale"): Tensor(f"{name}.weight", (d,)),
    (*path, "bias"): Tensor(f"{name}.bias", (d,)),
  }


def vision_tensors(config: VisionConfig, prefix: str = "") -> dict[tuple, Tensor]:
  """Every `VisionEncoder` param path -> its tensor in a SigLIP checkpoint under `prefix`."""
  d, n, h, m = config.d_model, config.num_heads, config.head_dim, config.mlp_dim
  c, p = config.channels, config.patch_size
  t = {
    ("patch_embed", "kernel"): Tensor("embeddings.patch_embedding.weight", (d, c, p, p), "patch"),
    ("patch_embed", "bias"): Tensor("embeddings.patch_embedding.bias", (d,)),
    ("pos_embed",): Tensor("embeddings.position_embedding.weight", (config.num_patches, d)),
    **_norm(("final_norm",), "post_layernorm", d),
  }
  for i in range(config.num_layers):
    b, name = ("blocks", i), f"encoder.layers.{i}"
    t |= _norm((*b, "attn_norm"), f"{name}.layer_norm1", d)
    t |= _norm((*b, "mlp_norm"), f"{name}.layer_norm2", d)
    for x in "qkv":
      t[(*b, "attn", f"{x}_kernel")] = _linear(f"{name}.self_attn.{x}_proj", n * h, d)
      t[(*b, "attn", f"{x}_bias")] = Tensor(f"{name}.self_attn.{x}_proj.bias", (n * h,))
    t[(*b, "attn", "o_kernel")] = _linear(f"{name}.self_attn.out_proj", d, n * h, split=2)
    t[(*b, "attn", "o_bias")] = Tensor(f"{name}.self_attn.out_proj.bias", (d,))
    t |= dense_tensors((*b, "fc1"), f"{name}.mlp.fc1", d, m)
    t |= dense_tensors((*b, "fc2"), f"{name}.mlp.fc2", m, d)
  if config.pool_head:
    t[("head", "probe")] = Tensor("head.probe", (1, 1, d))
    for i, x in enumerate("qkv"):
      w = Tensor("head.attention.in_proj_weight", (3 * n * h, d), "linear", part=(i, 3))
      t[("head", "attn", f"{x}_kernel")] = w
      t[("head", "attn", f"{x}_bias")] = Tensor(
        "head.attention.in_proj_bias", (3 * n * h,), part=(i, 3)
      )
    t[("head", "attn", "o_kernel")] = _linear("head.attention.out_proj", d, n * h, split=2)
    t[("head", "attn", "o_bias")] = Tensor("head.attention.out_proj.bias", (d,))
    t |= _norm(("head", "norm"), "head.layernorm", d)
    t |= dense_tensors(("head", "fc1"), "head.mlp.fc1", d, m)
    t |= dense_tensors(("head", "fc2"), "head.mlp.fc2", m, d)
  return {path: dataclasses.replace(x, name=prefix + x.name) for path, x in t.items()}


def _key(path) -> tuple:
  return tuple(int(p) if isinstance(p, int | np.integer) else str(p) for p in path)


def load_mapped(
  entries: Mapping[str, Entry],
  state: nnx.State,
  table: Mapping[tuple, Tensor],
  *,
  where: str,
  mesh: jax.sharding.Mesh | None = None,
  dtype=np.float32,
) -> nnx.State:
  """Reads every param of `state` from `entries` by `table`; every entry must be used.

  Names and shapes are checked against the headers before any data is read; tensors are then
  read, converted and placed one at a time.
  """
  plan = []
  for key, variable in nnx.to_flat_state(state):
    key, shape = _key(key), tuple(hf._value(variable).shape)
    tensor = table.get(key)
    if tensor is None:
      raise ValueError(f"param {'/'.join(map(str, key))} has no Hugging Face counterpart.")
    entry = entries.get(tensor.name)
    if entry is None:
      raise ValueError(f"{where} lacks tensor {tensor.name!r} that the model needs.")
    if entry.shape != tensor.hf_shape:
      raise ValueError(
        f"tensor {tensor.name!r} in {where} has shape {entry.shape} but the model needs "
        f"{tensor.hf_shape}."
      )
    plan.append((key, variable, tensor, shape))
  used = {tensor.name for *_, tensor, _ in plan}
  for name in entries:
    if name not in used:
      raise ValueError(f"tensor {name!r} in {where} is not used by the model.")
  loaded = []
  for key, variable, tensor, shape in plan:
    array = tensor.to_knitjax(read_tensor(entries[tensor.name]).astype(dtype, copy=False), shape)
    value = hf._place(array, hf._sharding(variable, shape, mesh))
    loaded.append((key, variable.replace(value) if isinstance(variable, nnx.Variable) else value))
  return nnx.from_flat_state(loaded)


def mapped_items(state: nnx.State, table: Mapping[tuple, Tensor], dtype: np.dtype) -> list[tuple]:
  """`(name, shape, dtype, fetch)` per checkpoint tensor of `state` (for `hf.write_folder`)."""
  parts: dict[str, list] = {}
  for key, variable in nnx.to_flat_state(state):
    tensor = table.get(_key(key))
    if tensor is None:
      raise ValueError(f"param {'/'.join(map(str, _key(key)))} has no Hugging Face counterpart.")
    parts.setdefault(tensor.name, []).append((tensor, hf._value(variable)))
  items = []
  for name, group in parts.items():
    group.sort(key=lambda item: item[0].part[0])
    if [t.part for t, _ in group] != [(i, len(group)) for i in range(len(group))]:
      raise ValueError(f"tensor {name!r} needs all of its {group[0][0].part[1]} parts.")

    def fetch(group=group):
      pieces = [t.to_hf(hf._host(v, dtype)) for t, v in group]
      return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=0)

    items.append((name, group[0][0].hf_shape, dtype, fetch))
  return items


def detect_prefix(entries: Mapping[str, Entry], candidates, where: str) -> str:
  """The first candidate prefix under which `entries` hold a patch embedding."""
  for prefix in candidates:
    if prefix + "embeddings.patch_embedding.weight" in entries:
      return prefix
  names = ", ".join(repr(p + "embeddings.patch_embedding.weight") for p in candidates)
  raise ValueError(f"{where} holds no SigLIP tower; looked for {names}.")


def load_siglip_params(
  path: str | os.PathLike,
  encoder_or_state,
  mesh: jax.sharding.Mesh | None = None,
  *,
  dtype=np.float32,
) -> nnx.State:
  """Reads a `SiglipVisionModel` folder (4.x or 5.x names) into a VisionEncoder's params.

  Args:
    path: checkpoint folder (`model.safetensors` or an index with shards).
    encoder_or_state: a `VisionEncoder` (updated in place), or its state, concrete or abstract;
      its config decides the expected tensors (build it with `siglip_config_from_hf(path)`).
    mesh: when given, params get the NamedSharding of `knitjax.sharding`'s rules.
    dtype: the param dtype.
  """
  path = os.fspath(path)
  if isinstance(encoder_or_state, nnx.Module):
    config, state = encoder_or_state.config, nnx.state(encoder_or_state)
  else:
    config, state = None, encoder_or_state
  entries = hf.checkpoint_entries(path)
  prefix = detect_prefix(entries, tuple(SIGLIP_NAMINGS.values()), path)
  if config is None:
    config = siglip_config_from_hf(path)
  table = vision_tensors(config, prefix)
  new_state = load_mapped(entries, state, table, where=path, mesh=mesh, dtype=dtype)
  if isinstance(encoder_or_state, nnx.Module):
    nnx.update(encoder_or_state, new_state)
  return new_state


def save_siglip(
  encoder_or_state,
  config: VisionConfig,
  path: str | os.PathLike,
  *,
  naming: str = "v5",
  dtype=np.float32,
) -> None:
  """Writes a VisionEncoder as a `SiglipVisionModel` folder (config.json + model.safetensors).

  `naming`: "v5" (transformers 5.x names, `embeddings.*`) or "v4" (`vision_model.embeddings.*`).
  """
  if naming not in SIGLIP_NAMINGS:
    raise ValueError(
      f"save_siglip naming={naming!r} is unknown; accepted: {sorted(SIGLIP_NAMINGS)}."
    )
  dtype = hf._save_dtype(dtype)
  state = (
    nnx.state(encoder_or_state) if isinstance(encoder_or_state, nnx.Module) else encoder_or_state
  )
  items = mapped_items(state, vision_tensors(config, SIGLIP_NAMINGS[naming]), dtype)
  hf_config = siglip_config_to_hf(config) | {"torch_dtype": hf._TORCH_DTYPES[DTYPE_NAMES[dtype]]}
  hf.write_folder(path, items, hf_config, dtype=dtype)
