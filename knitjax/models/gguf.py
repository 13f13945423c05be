"""llama.cpp GGUF files -> Hugging Face checkpoint folders: weights, config and tokenizer.

`convert_gguf` dequantizes every tensor of a Llama-architecture GGUF to float32 and writes the
folder `knitjax.models.hf` loads: `config.json`, `model.safetensors` (Hugging Face names, with
llama.cpp's rotary row permutation of q/k undone), `tokenizer.json` (byte-level BPE rebuilt with
the `tokenizers` library from the GGUF vocabulary and merges), `tokenizer_config.json` (special
tokens, chat template) and `generation_config.json`. The weights, config and tokenizer mirror what
`transformers` builds from the same file (`modeling_gguf_pytorch_utils.LlamaTensorProcessor`,
`integrations/ggml.py`, `integrations/gguf/gguf_tokenizer_mapping.byte_level_tokenizer`), which
tests/models/test_gguf.py checks.

`knitjax.models.gguf_cache` converts a file once into a folder under the cache, and fetches the
SmolLM2-135M-Instruct GGUF used by tests and demos.
"""

import json
import os
import re
import struct

import numpy as np

from knitjax.models.safetensors_io import write_streamed

# Bump when convert_gguf's output changes: cached folders of another version are redone
# (`knitjax.models.gguf_cache`).
CONVERTER_VERSION = 1

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex transformers puts before ByteLevel; any other name keeps
# GPT-2's ByteLevel regex, as transformers does. Names transformers maps to splits not copied here
# (tekken, gpt-4o, qwen35, ...) are refused rather than tokenized differently.
_PRE_SPLITS = {
  **dict.fromkeys(
    [
      "llama3",
      "llama-v3",
      "llama-bpe",
      "falcon3",
      "falcon-h1",
      "pixtral",
      "midm-2.0",
      "lfm2",
      "jina-v5-nano",
      "dbrx",
      "smaug-bpe",
    ],
    _LLAMA3_SPLIT,
  ),
  **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
}
_PRE_UNSUPPORTED = ("tekken", "qwen35", "gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")

_BLOCK_NAMES = {
  "attn_norm": "input_layernorm",
  "ffn_norm": "post_attention_layernorm",
  "attn_q": "self_attn.q_proj",
  "attn_k": "self_attn.k_proj",
  "attn_v": "self_attn.v_proj",
  "attn_output": "self_attn.o_proj",
  "ffn_gate": "mlp.gate_proj",
  "ffn_up": "mlp.up_proj",
  "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
}


def _metadata(reader) -> dict:
  """Every metadata field except the big token arrays, as Python values."""
  skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
  return {k: f.contents() for k, f in reader.fields.items() if k not in skip}


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's q/k permutation (transformers' `_reverse_permute_weights`).

  llama.cpp's converter reorders each head's rows from rotate-half order into interleaved pairs
  for its own RoPE kernel; Hugging Face's (and knitjax's) RoPE wants rotate-half order back.
  """
  return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _hf_config(meta: dict, path: str, tensor_names: set[str], vocab_size: int) -> dict:
  def get(key, default=None, *, required=False):
    value = meta.get(f"llama.{key}", default)
    if required and value is None:
      raise ValueError(f"{path} lacks the metadata field llama.{key}; accepted: a llama GGUF.")
    return value

  hidden, heads = get("embedding_length", required=True), get("attention.head_count", required=True)
  head_dim = get("attention.key_length", hidden // heads)
  rotary = get("rope.dimension_count", head_dim)
  if rotary != head_dim:
    raise ValueError(f"{path} has llama.rope.dimension_count={rotary}; accepted: {head_dim}.")
  scaling = get("rope.scaling.type", "none")
  if scaling != "none" or "rope_freqs.weight" in tensor_names:
    what = "rope_freqs.weight" if scaling == "none" else f"llama.rope.scaling.type={scaling!r}"
    raise ValueError(f"{path} has {what} (RoPE scaling); accepted: plain RoPE.")

  def token_id(key):
    value = meta.get(f"tokenizer.ggml.{key}")
    return None if value is None else int(value)

  return {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": int(get("vocab_size", vocab_size)),
    "hidden_size": int(hidden),
    "intermediate_size": int(get("feed_forward_length", required=True)),
    "num_hidden_layers": int(get("block_count", required=True)),
    "num_attention_heads": int(heads),
    "num_key_value_heads": int(get("attention.head_count_kv", heads)),
    "head_dim": int(head_dim),
    "max_position_embeddings": int(get("context_length", 2048)),
    "hidden_act": "silu",
    # GGUF stores float32: its shortest repr (1e-05, not 9.9999997e-06) is the original value.
    "rms_norm_eps": float(str(np.float32(get("attention.layer_norm_rms_epsilon", 1e-6)))),
    "rope_theta": float(str(np.float32(get("rope.freq_base", 10_000.0)))),
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": "output.weight" not in tensor_names,
    "bos_token_id": token_id("bos_token_id"),
    "eos_token_id": token_id("eos_token_id"),
    "pad_token_id": token_id("padding_token_id"),
    "torch_dtype": "float32",
  }


def _hf_name(name: str, path: str) -> tuple[str, str | None]:
  """(Hugging Face name, "q" / "k" when the rows need un-permuting) of a llama.cpp tensor."""
  if name in _TOP_NAMES:
    return _TOP_NAMES[name], None
  match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
  if match is None or match[2] not in _BLOCK_NAMES:
    raise ValueError(
      f"{path} has tensor {name!r}, which knitjax's llama mapping does not know; accepted: "
      f"{sorted(_TOP_NAMES)} and blk.N.{{{','.join(_BLOCK_NAMES)}}}.weight."
    )
  permute = {"attn_q": "q", "attn_k": "k"}.get(match[2])
  return f"model.layers.{match[1]}.{_BLOCK_NAMES[match[2]]}.weight", permute


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table (byte-level BPE spells tokens in it)."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
  keep += range(ord("®"), ord("ÿ") + 1)
  table, extra = {b: chr(b) for b in keep}, 0
  for b in range(256):
    if b not in table:
      table[b], extra = chr(256 + extra), extra + 1
  return table


def _tokenizer_json(reader, meta: dict, path: str, add_bos: bool, add_eos: bool) -> str:
  """`tokenizer.json` of the GGUF's byte-level BPE, as transformers' GGUF converter builds it."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

  kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
  if kind != "gpt2":
    raise ValueError(
      f"{path} has tokenizer.ggml.model={kind!r}; accepted: 'gpt2' (byte-level BPE)."
    )
  if pre in _PRE_UNSUPPORTED:
    raise ValueError(
      f"{path} has tokenizer.ggml.pre={pre!r}, whose split regex is not implemented; accepted: "
      f"any other, e.g. {sorted(_PRE_SPLITS)[:3]} or 'smollm'."
    )
  fields = reader.fields
  tokens = fields["tokenizer.ggml.tokens"].contents()
  types = fields.get("tokenizer.ggml.token_type")
  types = [] if types is None else types.contents()
  if "tokenizer.ggml.merges" not in fields:
    raise ValueError(f"{path} has no tokenizer.ggml.merges; accepted: BPE with merges.")
  merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"].contents()]
  spelling = _bytes_to_unicode()
  alphabet = set(spelling.values())
  vocab = {
    t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
    for i, t in enumerate(tokens)
  }
  tok = Tokenizer(
    models.BPE(
      vocab=vocab,
      merges=merges,
      dropout=None,
      continuing_subword_prefix="",
      end_of_word_suffix="",
      fuse_unk=False,
    )
  )
  split = _PRE_SPLITS.get(pre)
  if split is None:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    tok.pre_tokenizer = pre_tokenizers.Sequence(
      [
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
    )
  tok.decoder = decoders.ByteLevel()
  # Control tokens whole and special; one spelled outside the byte alphabet is a llama.cpp
  # mislabel (transformers skips it too, as adding it would grow the vocabulary).
  tok.add_special_tokens(
    [
      AddedToken(t, normalized=False, special=True)
      for t, kind in zip(tokens, types, strict=False)
      if kind == _CONTROL and set(t) <= alphabet
    ]
  )
  tok.add_tokens(
    [
      AddedToken(t, normalized=False, special=False)
      for t, kind in zip(tokens, types, strict=False)
      if kind == _USER_DEFINED and t in vocab
    ]
  )
  special = _special_tokens(meta, tokens)
  tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special.values()])
  bos, eos = special.get("bos_token"), special.get("eos_token")
  add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
  single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
  pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
  ids = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
  tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)
  return tok.to_str()


def _special_tokens(meta: dict, tokens: list[str]) -> dict[str, str]:
  keys = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
  out = {}
  for name, key in keys.items():
    index = meta.get(f"tokenizer.ggml.{key}_token_id")
    if index is not None and 0 <= int(index) < len(tokens):
      out[name] = tokens[int(index)]
  return out


# The fewest bytes a GGUF record can take: a metadata field is a key length (8), a type (4) and a
# value (>= 1); a tensor's info is a name length (8), a dimension count (4), a type (4), an offset.
_MIN_FIELD_BYTES, _MIN_TENSOR_BYTES, _HEADER_BYTES = 13, 24, 24


def _check_counts(path: str) -> None:
  """Refuses a GGUF whose header declares more tensors or metadata fields than the file can hold
  (the reader would otherwise index past its arrays, or loop over 10**12 records)."""
  try:
    with open(path, "rb") as f:
      header = f.read(_HEADER_BYTES)
      size = os.fstat(f.fileno()).st_size
  except OSError as e:
    raise ValueError(f"{path} cannot be read ({e.strerror or type(e).__name__}).") from None
  if len(header) < _HEADER_BYTES or header[:4] != b"GGUF":
    raise ValueError(f"{path} cannot be read as a GGUF file (no GGUF header).")
  # Little-endian as written by llama.cpp on every common machine; a big-endian file reads as a
  # huge count here and the reader would refuse it anyway.
  tensors, fields = struct.unpack("<QQ", header[8:24])
  if tensors * _MIN_TENSOR_BYTES + fields * _MIN_FIELD_BYTES > size - _HEADER_BYTES:
    raise ValueError(
      f"{path} declares {tensors:,} tensors and {fields:,} metadata fields, more than its "
      f"{size:,} bytes can hold; the file is damaged or not a GGUF."
    )


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> str:
  """Writes a Hugging Face Llama folder (float32 weights, tokenizer, configs) from a GGUF file.

  Args:
    gguf_path: a llama.cpp GGUF of architecture `llama` with a `gpt2` (byte-level BPE) tokenizer.
    out_dir: folder to write (created if missing; files of the same names are overwritten).

  Returns:
    `out_dir`, loadable with `knitjax.models.hf.init_from_hf` and transformers' `from_pretrained`.

  Raises:
    ValueError: one sentence naming the file and the field or tensor it cannot convert.
  """
  import gguf

  path, out_dir = os.fspath(gguf_path), os.fspath(out_dir)
  _check_counts(path)
  try:
    reader = gguf.GGUFReader(path)
  except (OSError, ValueError, KeyError, IndexError, TypeError, OverflowError, MemoryError) as e:
    reason = str(e).splitlines()[0][:200] if str(e) else "no detail"
    raise ValueError(
      f"{path} cannot be read as a GGUF file ({type(e).__name__}: {reason})."
    ) from None
  meta = _metadata(reader)
  arch = meta.get("general.architecture")
  if arch != "llama":
    raise ValueError(f"{path} has general.architecture={arch!r}; accepted: 'llama'.")
  tensors = {t.name: t for t in reader.tensors}
  if "tokenizer.ggml.tokens" not in reader.fields:
    raise ValueError(f"{path} lacks the metadata field tokenizer.ggml.tokens (the vocabulary).")
  tokens = reader.fields["tokenizer.ggml.tokens"].contents()
  config = _hf_config(meta, path, set(tensors), len(tokens))
  heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

  items = []
  for name, tensor in sorted(tensors.items()):
    hf_name, permute = _hf_name(name, path)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first

    def fetch(tensor=tensor, permute=permute, shape=shape):
      w = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
      w = w.reshape(shape)
      if permute:
        w = _unpermute_rows(w, heads if permute == "q" else kv_heads)
      return w

    items.append((hf_name, shape, np.dtype(np.float32), fetch))
  layers = config["num_hidden_layers"]
  want = {"model.embed_tokens.weight", "model.norm.weight"} | {
    f"model.layers.{i}.{n}.weight" for i in range(layers) for n in _BLOCK_NAMES.values()
  }
  missing = sorted(want - {item[0] for item in items})
  if missing:
    raise ValueError(f"{path} lacks the tensor for {missing[0]!r} ({len(missing)} missing).")

  add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
  add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
  tokenizer_json = _tokenizer_json(reader, meta, path, add_bos, add_eos)
  tokenizer_config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    **_special_tokens(meta, tokens),
    "add_bos_token": add_bos,
    "add_eos_token": add_eos,
    "model_max_length": config["max_position_embeddings"],
    "clean_up_tokenization_spaces": False,
  }
  if "tokenizer.chat_template" in meta:
    tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
  generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}

  os.makedirs(out_dir, exist_ok=True)
  write_streamed(os.path.join(out_dir, "model.safetensors"), items)
  files = {
    "config.json": config,
    "generation_config.json": generation,
    "tokenizer_config.json": tokenizer_config,
  }
  for file, value in files.items():
    with open(os.path.join(out_dir, file), "w") as f:
      json.dump(value, f, indent=2, ensure_ascii=False)
  with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
    f.write(tokenizer_json)
  return out_dir
