"""HFTokenizer against transformers' AutoTokenizer on tokenizers trained here, offline."""

import json
import os
import random

import numpy as np
import pytest
from tokenizers import (
  AddedToken,
  Regex,
  Tokenizer,
  decoders,
  models,
  normalizers,
  pre_tokenizers,
  processors,
  trainers,
)

from knitjax.models.hf_tokenizer import UNKNOWN_CHAR, HFTokenizer

transformers = pytest.importorskip("transformers")

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>"]
# Qwen2's pre-tokenizer split (GPT-4 style): letters, single digits, punctuation, spaces.
QWEN_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PIECES = [
  "hello",
  "world",
  " the",
  " quick brown fox",
  "Answer: 42",
  "3.14159",
  "1,000,000",
  "你好世界",
  "日本語のテキスト",
  "한국어",
  "😀",
  "👩‍👩‍👧‍👦",
  "🇯🇵",
  "e\u0301",
  "n\u0303a\u0308",
  "Zalgo: z\u0351\u0352a\u0353",
  "مرحبا بالعالم",
  "שלום",
  "\u200f",
  "Ω≈ç√∫",
  "  ",
  "    ",
  "\t",
  "\t\t",
  "\n",
  "\n\n",
  "\r\n",
  " \n ",
  "x=y+1;",
  "don't",
  "I'm",
  "<|im_start|>",
  "<|im_end|>",
  "<|endoftext|>",
  "<|im_start",
  "|>",
  "<|begin_of_text|>",
  "<|eot_id|>",
]


def _corpus(n: int = 400) -> list[str]:
  rng = random.Random(1)
  words = [p for p in PIECES if not p.startswith("<|")]
  return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(n)]


def _strings(n: int = 1200) -> list[str]:
  """Test strings: every piece alone, then random joins of 1-8 pieces with random separators."""
  rng = random.Random(0)
  out = ["", " ", "  leading", "trailing  ", *PIECES]
  while len(out) < n:
    sep = rng.choice(["", " ", "  ", "\n", "\t", " \t\n"])
    out.append(sep.join(rng.choice(PIECES) for _ in range(rng.randint(1, 8))))
  return out


def _byte_level_bpe(specials: list[str], *, qwen_split: bool) -> Tokenizer:
  tok = Tokenizer(models.BPE())
  tok.normalizer = normalizers.NFC()
  if qwen_split:
    tok.pre_tokenizer = pre_tokenizers.Sequence(
      [
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
    )
  else:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=700,
    special_tokens=specials,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(_corpus(), trainer)
  return tok


def _write(folder, name: str, value) -> None:
  with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
    json.dump(value, f)


def _edit_config(folder, **changes) -> None:
  path = os.path.join(folder, "tokenizer_config.json")
  with open(path, encoding="utf-8") as f:
    config = json.load(f)
  for k, v in changes.items():
    if v is None:
      config.pop(k, None)
    else:
      config[k] = v
  _write(folder, "tokenizer_config.json", config)


@pytest.fixture(scope="module")
def chatml_folder(tmp_path_factory):
  """A Qwen-like folder: byte-level BPE, ByteLevel post-processor, no BOS, eos <|im_end|>."""
  tok = _byte_level_bpe(CHATML_SPECIALS, qwen_split=True)
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  folder = tmp_path_factory.mktemp("chatml")
  fast = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
  )
  fast.save_pretrained(folder)
  _edit_config(folder, add_bos_token=False)  # as Qwen2.5's tokenizer_config.json says (ignored)
  return folder


@pytest.fixture(scope="module")
def chatml(chatml_folder):
  return HFTokenizer.from_folder(chatml_folder), transformers.AutoTokenizer.from_pretrained(
    chatml_folder
  )


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
  """A Llama-3-like folder: the post-processor adds <|begin_of_text|>; two stop tokens."""
  tok = _byte_level_bpe(LLAMA_SPECIALS, qwen_split=False)
  bos = "<|begin_of_text|>"
  tok.post_processor = processors.Sequence(
    [
      processors.ByteLevel(trim_offsets=False),
      processors.TemplateProcessing(
        single=f"{bos}:0 $A:0",
        pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, tok.token_to_id(bos))],
      ),
    ]
  )
  folder = tmp_path_factory.mktemp("llama")
  tok.save(str(folder / "tokenizer.json"))
  _write(
    folder,
    "tokenizer_config.json",
    {
      # An AddedToken dict, as older Hub folders store them.
      "bos_token": {"__type": "AddedToken", "content": bos, "special": True},
      "eos_token": "<|eot_id|>",
      "tokenizer_class": "PreTrainedTokenizerFast",
      "added_tokens_decoder": {
        str(tok.token_to_id(t)): {"content": t, "special": True} for t in LLAMA_SPECIALS
      },
    },
  )
  eot, end = tok.token_to_id("<|eot_id|>"), tok.token_to_id("<|end_of_text|>")
  _write(folder, "generation_config.json", {"bos_token_id": 0, "eos_token_id": [eot, end]})
  _write(folder, "config.json", {"eos_token_id": end, "vocab_size": 1024})
  return folder


@pytest.fixture(scope="module")
def llama(llama_folder):
  return HFTokenizer.from_folder(llama_folder), transformers.AutoTokenizer.from_pretrained(
    llama_folder
  )


@pytest.mark.parametrize("name", ["chatml", "llama"])
def test_encode_matches_transformers(name, request):
  ours, ref = request.getfixturevalue(name)
  strings = _strings()
  assert len(strings) >= 1000
  with_special = ref(strings)["input_ids"]
  without = ref(strings, add_special_tokens=False)["input_ids"]
  mismatches = [
    s
    for s, a, b in zip(strings, with_special, without, strict=True)
    if ours.encode(s) != a or ours.encode(s, bos=False) != b
  ]
  assert mismatches == []
  assert ours.num_tokens(strings[-1]) == len(with_special[-1])
  # The embedded special tokens really were read as single special ids.
  assert ours.encode("<|eot_id|>" if name == "llama" else "<|im_end|>", bos=False) == [ours.eos_id]


@pytest.mark.parametrize("name", ["chatml", "llama"])
def test_decode_matches_transformers(name, request):
  ours, ref = request.getfixturevalue(name)
  rng = np.random.default_rng(0)
  sequences = [ours.encode(s) for s in _strings(300)]
  # Random ids split multi-byte characters and interleave special tokens.
  sequences += [
    rng.integers(0, ours.vocab_size, size=rng.integers(0, 30)).tolist() for _ in range(300)
  ]
  for ids in sequences:
    cut = next((i for i, t in enumerate(ids) if t in ours.eos_ids), len(ids))
    assert ours.decode(ids) == ref.decode(ids[:cut], skip_special_tokens=True), ids


def test_special_tokens_match_transformers(chatml, llama):
  for ours, ref in (chatml, llama):
    assert ours.vocab_size == len(ref)
    assert ours.eos_id == ref.eos_token_id
    assert ours.bos_id == ref.bos_token_id
  ours, ref = chatml
  assert ours.bos_id is None
  assert ours.eos_ids == (ref.convert_tokens_to_ids("<|im_end|>"),)
  assert ours.pad_id == ref.pad_token_id == ref.convert_tokens_to_ids("<|endoftext|>")


def test_llama3_bos_and_stop_tokens(llama):
  ours, ref = llama
  bos, end, eot = (ref.convert_tokens_to_ids(t) for t in LLAMA_SPECIALS[:3])
  assert ours.bos_id == bos
  assert ours.encode("hi")[0] == bos and ours.encode("hi", bos=False)[0] != bos
  assert ours.encode("") == [bos] and ours.encode("", bos=False) == []
  assert ours.eos_ids == (eot, end)  # tokenizer eos first, then generation/config.json, no repeats
  assert ours.eos_id == eot
  assert ours.pad_id == eot  # no pad token anywhere: the first eos
  hello = ours.encode("hello", bos=False)
  assert ours.decode([bos, *hello, end, *hello]) == "hello"
  assert ours.decode([bos, *hello, eot, *hello]) == "hello"
  assert ours.decode([*hello, end, *hello], stop_at_eos=False) == "hello<|end_of_text|>hello"


def test_pad_from_config_json(llama_folder, tmp_path):
  folder = _copy(llama_folder, tmp_path)
  _write(folder, "config.json", {"pad_token_id": 7})
  tok = HFTokenizer.from_folder(folder)
  assert tok.pad_id == 7
  generation = json.loads((folder / "generation_config.json").read_text())
  assert tok.eos_ids == tuple(generation["eos_token_id"])


def _copy(src, dst):
  for name in os.listdir(src):
    with open(os.path.join(src, name), "rb") as f:
      data = f.read()
    with open(os.path.join(dst, name), "wb") as f:
      f.write(data)
  return dst


@pytest.mark.parametrize(
  "name, changes",
  [
    ("chatml", {"add_bos_token": True, "bos_token": "<|im_start|>"}),
    ("chatml", {"add_bos_token": True, "add_eos_token": True, "bos_token": "<|im_start|>"}),
    ("llama", {"add_bos_token": False}),
  ],
)
def test_add_bos_token_flags_are_ignored_like_transformers(name, changes, request, tmp_path):
  """With a tokenizer.json, transformers drops add_bos_token/add_eos_token: its post-processor
  alone decides what encode adds."""
  folder = _copy(request.getfixturevalue(f"{name}_folder"), tmp_path)
  _edit_config(folder, **changes)
  ours = HFTokenizer.from_folder(folder)
  ref = transformers.AutoTokenizer.from_pretrained(folder)
  for s in ["", "hello world", "你好 <|im_end|>"]:
    assert ours.encode(s) == ref(s)["input_ids"]
    assert ours.encode(s, bos=False) == ref(s, add_special_tokens=False)["input_ids"]
  hello = ours.encode("hello", bos=False)
  assert ours.encode("hello") == (hello if name == "chatml" else [ours.bos_id, *hello])


def test_special_tokens_map_overrides_legacy_config(chatml_folder, tmp_path):
  folder = _copy(chatml_folder, tmp_path)
  _edit_config(folder, eos_token="<|endoftext|>", pad_token=None)
  _write(
    folder,
    "special_tokens_map.json",
    {"eos_token": {"content": "<|im_end|>", "lstrip": False}, "pad_token": "<|im_start|>"},
  )
  ours = HFTokenizer.from_folder(folder)
  ref = transformers.AutoTokenizer.from_pretrained(folder)
  assert ours.eos_id == ref.eos_token_id == ours.encode("<|im_end|>", bos=False)[0]
  assert ours.pad_id == ref.pad_token_id == ours.encode("<|im_start|>", bos=False)[0]


def test_decode_unknown_and_negative_ids(chatml):
  ours, _ = chatml
  hello = ours.encode("hello")
  assert ours.decode([*hello, ours.vocab_size, *hello]) == f"hello{UNKNOWN_CHAR}hello"
  assert ours.decode(np.array([ours.vocab_size + 100])) == UNKNOWN_CHAR
  assert ours.decode([]) == ""
  with pytest.raises(ValueError, match="token id -1 is negative"):
    ours.decode([*hello, -1])


def test_check_fits(llama):
  ours, _ = llama
  ours.check_fits(ours.vocab_size)
  ours.check_fits(1024)
  with pytest.raises(
    ValueError, match=f"ids up to {ours.vocab_size - 1}, beyond .* vocab_size 10;"
  ):
    ours.check_fits(10)


def test_interface_matches_char_tokenizer(chatml):
  from knitjax.tasks.tokenizer import CharTokenizer

  ours, _ = chatml
  char = CharTokenizer("abc")
  for attr in ("pad_id", "bos_id", "eos_id", "eos_ids", "vocab_size"):
    assert hasattr(char, attr) and hasattr(ours, attr), attr
  assert isinstance(ours.eos_ids, tuple) and ours.eos_ids[0] == ours.eos_id


def _error(tmp_path, setup) -> str:
  setup(tmp_path)
  with pytest.raises(ValueError) as info:
    HFTokenizer.from_folder(tmp_path)
  return str(info.value)


def test_errors_name_the_file(chatml_folder, tmp_path):
  missing = tmp_path / "nope"
  with pytest.raises(ValueError, match="nope does not exist or is not a directory"):
    HFTokenizer.from_folder(missing)

  def only_spm(d):
    (d / "tokenizer.model").write_bytes(b"\x00")

  assert "only tokenizer.json" in _error(tmp_path / "a", lambda d: (d.mkdir(), only_spm(d)))
  msg = _error(tmp_path / "b", lambda d: d.mkdir())
  assert msg.endswith("tokenizer.json does not exist; a Hugging Face tokenizer folder needs it.")

  def bad_json(d):
    _copy(chatml_folder, d.mkdir() or d)
    (d / "tokenizer_config.json").write_text('{"eos_token": ')

  msg = _error(tmp_path / "c", bad_json)
  assert "tokenizer_config.json is not valid JSON" in msg and "line 1" in msg

  def unreadable(d):
    d.mkdir()
    (d / "tokenizer.json").mkdir()

  assert "cannot read" in _error(tmp_path / "d", unreadable)

  def not_a_tokenizer(d):
    d.mkdir()
    (d / "tokenizer.json").write_text('{"model": {"type": "Nonsense"}}')

  assert "is not a tokenizer the tokenizers library reads" in _error(
    tmp_path / "e", not_a_tokenizer
  )

  def unknown_eos(d):
    _copy(chatml_folder, d.mkdir() or d)
    _edit_config(d, eos_token="<|nope|>")

  msg = _error(tmp_path / "f", unknown_eos)
  assert "eos_token '<|nope|>'" in msg and "not in the vocabulary" in msg

  def bad_generation_config(d):
    _copy(chatml_folder, d.mkdir() or d)
    _write(d, "generation_config.json", {"eos_token_id": "2"})

  assert "eos_token_id in" in _error(tmp_path / "g", bad_generation_config)

  def no_eos(d):
    _copy(chatml_folder, d.mkdir() or d)
    _edit_config(d, eos_token=None)

  assert "names no EOS token" in _error(tmp_path / "h", no_eos)
  for msg in (_error(tmp_path / "i", no_eos),):
    assert msg.count(". ") == 0 and msg.endswith(".")


def test_token_added_only_as_added_token_keeps_normal_encoding(tmp_path):
  """A non-special added token is kept by decode, as skip_special_tokens=True keeps it."""
  tok = _byte_level_bpe(CHATML_SPECIALS, qwen_split=True)
  tok.add_tokens([AddedToken("<tool>", special=False)])
  transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok, eos_token="<|im_end|>"
  ).save_pretrained(tmp_path)
  ours = HFTokenizer.from_folder(tmp_path)
  ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
  ids = ours.encode("a<tool>b<|endoftext|>c")
  assert ids == ref("a<tool>b<|endoftext|>c")["input_ids"]
  assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == "a<tool>bc"


@pytest.mark.parametrize(
  "file, field, value",
  [
    ("generation_config.json", "eos_token_id", [10**12]),
    ("generation_config.json", "eos_token_id", 2**40),
    ("config.json", "eos_token_id", 10**12),
    ("config.json", "pad_token_id", 10**12),
  ],
)
def test_ids_outside_the_vocabulary_name_the_file(chatml_folder, tmp_path, file, field, value):
  def setup(d):
    _copy(chatml_folder, d.mkdir() or d)
    if field == "pad_token_id":  # config.json's pad id is read when the tokenizer names none
      _edit_config(d, pad_token=None)
    _write(d, file, {field: value})

  msg = _error(tmp_path / "x", setup)
  bad = value[0] if isinstance(value, list) else value
  assert msg.startswith(f"{field} {bad} in ") and f"{file} is not an id of " in msg, msg
  assert "\n" not in msg
