"""A Hugging Face tokenizer folder behind the interface tasks and rewards use (`CharTokenizer`'s).

`HFTokenizer.from_folder` reads ``tokenizer.json`` with the `tokenizers` library and resolves
special tokens, BOS handling and the chat template the way `transformers`' ``AutoTokenizer`` does
for a fast tokenizer (``TokenizersBackend`` in transformers 5), without importing `transformers`:

* bos/eos/unk/pad come from ``tokenizer_config.json`` (strings or ``{"content": ...}`` dicts).
  When that file has no ``added_tokens_decoder`` (older folders), ``special_tokens_map.json``
  overrides it, as transformers' legacy loading does.
* ``encode(text, bos=True)`` is ``add_special_tokens=True``: the ``tokenizer.json``
  post-processor alone decides what is added (Llama 3's adds ``<|begin_of_text|>``, Qwen's
  nothing). transformers drops ``add_bos_token``/``add_eos_token`` from ``tokenizer_config.json``
  whenever a ``tokenizer.json`` exists (``_from_pretrained``), so they are ignored here too.
* The stop tokens are the union of the tokenizer's eos, ``generation_config.json`` and
  ``config.json`` ``eos_token_id`` (Llama 3 Instruct stops on ``<|eot_id|>`` and
  ``<|end_of_text|>``).
"""

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from knitjax.models.chat_template import ChatTemplate, load_chat_template

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
# The named special tokens transformers passes to chat templates (PreTrainedTokenizerBase).
SPECIAL_TOKEN_NAMES = (
  "bos_token",
  "eos_token",
  "unk_token",
  "sep_token",
  "pad_token",
  "cls_token",
  "mask_token",
)
# U+FFFD for ids the tokenizer has no token for (a model vocabulary padded past the tokenizer's).
UNKNOWN_CHAR = "\ufffd"


def _read_text(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"cannot read {path}: {e}.") from None


def _parse_json(text: str, path: str) -> dict[str, Any]:
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(
      f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})."
    ) from None
  if not isinstance(value, dict):
    raise ValueError(f"{path} holds a JSON {type(value).__name__}; it must hold a JSON object.")
  return value


def _read_json(path: str) -> dict[str, Any] | None:
  """Returns the JSON object in ``path``, or None when there is no such file."""
  if not os.path.exists(path):
    return None
  return _parse_json(_read_text(path), path)


def _token_text(value: Any, where: str) -> str | None:
  """A special token's text from a config value: a string, an AddedToken dict, or null."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, dict) and isinstance(value.get("content"), str):
    return value["content"]
  raise ValueError(f"{where} is {value!r}; it must be a string, null, or a dict with 'content'.")


def _id_list(value: Any, where: str) -> list[int]:
  """``eos_token_id``-style values: an int, a list of ints, or null."""
  if value is None:
    return []
  values = value if isinstance(value, list) else [value]
  if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
    raise ValueError(f"{where} is {value!r}; it must be a token id >= 0 or a list of them.")
  return list(values)


def _is_id(tokenizer: Tokenizer, i: int) -> bool:
  # id_to_token raises OverflowError beyond 32 bits; no vocabulary is that large.
  return i < 2**31 and tokenizer.id_to_token(i) is not None


class HFTokenizer:
  """A Hugging Face fast tokenizer with the `CharTokenizer` interface.

  Attributes:
    pad_id: the pad token's id. Without a pad token in the tokenizer config it is
      ``config.json``'s ``pad_token_id``, else the first EOS id (padding is masked out anyway).
    bos_id: the BOS token's id, or None when the tokenizer has none (Qwen).
    eos_id: the first stop id (the tokenizer's own eos token when it has one).
    eos_ids: every stop id, in order, without repeats.
    vocab_size: ids the tokenizer knows, added tokens included.
    chat_template: the Jinja chat template text, or None.
  """

  def __init__(
    self,
    tokenizer: Tokenizer,
    *,
    special_tokens: Mapping[str, str],
    eos_ids: Sequence[int],
    pad_id: int,
    chat_template: str | None = None,
    chat_template_origin: str = "the chat template",
    template_tokens: Mapping[str, str] | None = None,
    name: str = "",
  ):
    self._tokenizer = tokenizer
    self.special_tokens = dict(special_tokens)
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    self._max_id = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    bos = self.special_tokens.get("bos_token")
    self.bos_id = None if bos is None else tokenizer.token_to_id(bos)
    self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
    if not self.eos_ids:
      raise ValueError(f"tokenizer {name or '(unnamed)'} has no EOS id; it needs at least one.")
    self.eos_id = self.eos_ids[0]
    self.pad_id = int(pad_id)
    self.chat_template = chat_template
    self._template_vars = {**(template_tokens or {}), **self.special_tokens}
    self._template = (
      None if chat_template is None else ChatTemplate(chat_template, chat_template_origin)
    )
    self.name = name

  @classmethod
  def from_folder(cls, path: str | os.PathLike) -> "HFTokenizer":
    """Loads a Hugging Face tokenizer folder (``tokenizer.json`` plus its JSON configs).

    Raises:
      ValueError: one sentence naming the file, for a missing ``tokenizer.json`` (also when only
        the slow SentencePiece ``tokenizer.model`` is there), malformed JSON, an unreadable file,
        or a special token that is not in the vocabulary.
    """
    folder = os.fspath(path)
    if not os.path.isdir(folder):
      raise ValueError(f"tokenizer folder {folder} does not exist or is not a directory.")
    tok_path = os.path.join(folder, TOKENIZER_FILE)
    if not os.path.exists(tok_path):
      if os.path.exists(os.path.join(folder, "tokenizer.model")):
        raise ValueError(
          f"{folder} has only the slow SentencePiece tokenizer.model; only tokenizer.json (a fast "
          "tokenizer, e.g. saved by transformers' AutoTokenizer.save_pretrained) is supported."
        )
      raise ValueError(f"{tok_path} does not exist; a Hugging Face tokenizer folder needs it.")
    tok_text = _read_text(tok_path)
    _parse_json(tok_text, tok_path)  # a JSON error names its line; the Rust loader's does not
    try:
      tokenizer = Tokenizer.from_str(tok_text)
    except Exception as e:  # the Rust loader raises a bare Exception
      reason = str(e).strip().rstrip(".")
      raise ValueError(
        f"{tok_path} is not a tokenizer the tokenizers library reads ({reason})."
      ) from None

    cfg_path = os.path.join(folder, TOKENIZER_CONFIG_FILE)
    config = _read_json(cfg_path) or {}
    sources = {k: (config[k], cfg_path) for k in SPECIAL_TOKEN_NAMES if k in config}
    if "added_tokens_decoder" not in config:
      # transformers' legacy path: special_tokens_map.json overrides tokenizer_config.json.
      map_path = os.path.join(folder, SPECIAL_TOKENS_MAP_FILE)
      for k, v in (_read_json(map_path) or {}).items():
        if k in SPECIAL_TOKEN_NAMES:
          sources[k] = (v, map_path)
    special = {}
    for key, (value, where) in sources.items():
      text = _token_text(value, f"{key} in {where}")
      if text is None:
        continue
      if tokenizer.token_to_id(text) is None:
        raise ValueError(f"{key} {text!r} in {where} is not in the vocabulary of {tok_path}.")
      special[key] = text
    if "pad_token" not in special and tokenizer.padding is not None:
      special["pad_token"] = tokenizer.padding["pad_token"]  # transformers reads it from there too

    # As transformers' encode does without padding or truncation arguments.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.encode_special_tokens = bool(config.get("split_special_tokens", False))

    model_path = os.path.join(folder, MODEL_CONFIG_FILE)
    gen_path = os.path.join(folder, GENERATION_CONFIG_FILE)
    model_config = _read_json(model_path) or {}
    gen_config = _read_json(gen_path) or {}
    eos_ids = []
    if "eos_token" in special:
      eos_ids.append(tokenizer.token_to_id(special["eos_token"]))
    for cfg, where in ((gen_config, gen_path), (model_config, model_path)):
      for i in _id_list(cfg.get("eos_token_id"), f"eos_token_id in {where}"):
        if not _is_id(tokenizer, i):
          raise ValueError(f"eos_token_id {i} in {where} is not an id of {tok_path}.")
        eos_ids.append(i)
    if not eos_ids:
      raise ValueError(
        f"{folder} names no EOS token: set eos_token in {TOKENIZER_CONFIG_FILE} or eos_token_id in "
        f"{GENERATION_CONFIG_FILE} or {MODEL_CONFIG_FILE}."
      )
    if "pad_token" in special:
      pad_id = tokenizer.token_to_id(special["pad_token"])
    else:
      pads = _id_list(model_config.get("pad_token_id"), f"pad_token_id in {model_path}")
      if pads and not _is_id(tokenizer, pads[0]):
        raise ValueError(f"pad_token_id {pads[0]} in {model_path} is not an id of {tok_path}.")
      pad_id = pads[0] if pads else eos_ids[0]

    # transformers also hands the template model-specific tokens such as "image_token".
    extra = config.get("extra_special_tokens")
    template_tokens = {
      k: v
      for k, v in {**config, **(extra if isinstance(extra, dict) else {})}.items()
      if k.endswith("_token") and k not in SPECIAL_TOKEN_NAMES and isinstance(v, str)
    }
    template, origin = load_chat_template(folder, config)
    return cls(
      tokenizer,
      special_tokens=special,
      eos_ids=eos_ids,
      pad_id=pad_id,
      chat_template=template,
      chat_template_origin=origin,
      template_tokens=template_tokens,
      name=folder,
    )

  def encode(self, text: str, *, bos: bool = True) -> list[int]:
    """Returns the ids of ``text``, with special tokens added when ``bos`` (BOS for Llama 3).

    ``bos=True`` is transformers' ``add_special_tokens=True``: whatever tokenizer.json's
    post-processor adds, which for Qwen is nothing. ``bos=False`` adds nothing.
    """
    if not isinstance(text, str):
      raise ValueError(f"text to encode is a {type(text).__name__}; it must be a str.")
    return self._tokenizer.encode(text, add_special_tokens=bos).ids

  def num_tokens(self, text: str, *, bos: bool = True) -> int:
    """Returns ``len(encode(text, bos=bos))``."""
    return len(self.encode(text, bos=bos))

  def decode(self, ids: Iterable[int] | np.ndarray, *, stop_at_eos: bool = True) -> str:
    """Returns the text of ``ids`` with special tokens skipped (``skip_special_tokens=True``).

    With ``stop_at_eos`` the text ends at the first of any EOS id; otherwise each EOS stays visible
    as its token text (e.g. "<|im_end|>") so callers can tell it was produced, as
    `CharTokenizer.decode` keeps "<eos>". An id the tokenizer has no token for (at or above
    ``vocab_size``: a model vocabulary padded past the tokenizer's) becomes one U+FFFD, which no
    reward reads as part of an answer.

    Raises:
      ValueError: for a negative id, which no model samples.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and ids.min() < 0:
      raise ValueError(f"token id {int(ids.min())} is negative; token ids are >= 0.")
    eos = np.isin(ids, np.asarray(self.eos_ids, dtype=np.int64))
    if stop_at_eos and eos.any():
      ids, eos = ids[: int(np.argmax(eos))], eos[: int(np.argmax(eos))]
    unknown = ids > self._max_id
    if not unknown.any() and not eos.any():
      return self._tokenizer.decode(ids.tolist(), skip_special_tokens=True)
    # Decode the runs between unknown ids and EOS tokens separately, joined by their stand-ins.
    out, start = [], 0
    for pos in np.flatnonzero(unknown | eos).tolist():
      out.append(self._tokenizer.decode(ids[start:pos].tolist(), skip_special_tokens=True))
      out.append(
        UNKNOWN_CHAR
        if unknown[pos]
        else self._tokenizer.decode([int(ids[pos])], skip_special_tokens=False)
      )
      start = pos + 1
    out.append(self._tokenizer.decode(ids[start:].tolist(), skip_special_tokens=True))
    return "".join(out)

  def apply_chat_template(
    self,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tokenize: bool = False,
    **kwargs: Any,
  ) -> str | list[int]:
    """Renders ``messages`` with the model's chat template, as transformers does.

    Args:
      messages: dicts with "role" and "content".
      add_generation_prompt: end with the header that opens the assistant's turn.
      tokenize: return ids (encoded without adding special tokens, since the template writes
        them) instead of text.
      **kwargs: template variables (``tools``, ``date_string``, ``enable_thinking``...); they
        override the special tokens of the same name.

    Raises:
      ValueError: when the tokenizer has no chat template, or the template fails or renders "".
    """
    if self._template is None:
      raise ValueError(
        f"tokenizer {self.name or '(unnamed)'} has no chat template (no chat_template.jinja and no "
        "chat_template in tokenizer_config.json)."
      )
    text = self._template.render(
      messages,
      add_generation_prompt=add_generation_prompt,
      **{**self._template_vars, **kwargs},
    )
    if not text:
      raise ValueError(
        f"{self._template.origin} rendered the messages as an empty prompt; a chat template must "
        "write at least the turn it is given."
      )
    return self.encode(text, bos=False) if tokenize else text

  def check_fits(self, model_vocab_size: int) -> None:
    """Raises a ValueError when the tokenizer has ids the model has no embedding row for."""
    if self._max_id >= model_vocab_size:
      raise ValueError(
        f"tokenizer {self.name or '(unnamed)'} has token ids up to {self._max_id}, beyond the "
        f"model's vocab_size {model_vocab_size}; use the tokenizer that belongs to the checkpoint."
      )

  def __repr__(self) -> str:
    return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_ids={self.eos_ids})"
