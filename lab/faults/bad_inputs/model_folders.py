"""Hostile model folders: chat templates that raise, recurse, loop or explode; stop ids beyond the
vocabulary; GGUF files whose counts lie.

What a downloaded model folder holds is code (a Jinja chat template) and numbers the loader trusts
(ids, tensor and metadata counts). Each input here is a valid tiny folder or GGUF file with one
hostile part, fed to what a run or ``knitjax.chat`` calls on it (`HFTokenizer.from_folder` and
``apply_chat_template``, `knitjax.models.gguf.convert_gguf`). Every input runs isolated
(`BadInput.timeout_s`): a forked child with bounded memory, so a template that renders forever or
allocates a terabyte is counted as a hang or a traceback instead of stopping the suite.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from hypothesis import strategies as st

from lab.faults.bad_inputs.core import BadInput, Case, Draw, baseline, fresh_copy

TIMEOUT_S = 30.0  # a render or conversion that takes longer is a hang
_MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
_TEMPLATE_FILE = "chat_template.jinja"
_GOOD_TEMPLATE = (
  "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
  "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "What", "is", "2", "+", "3", "?"]


def _write_tokenizer_folder(path: str) -> None:
  """A complete tiny Hugging Face tokenizer folder (word-level) with a chat template file."""
  from tokenizers import Tokenizer, models, pre_tokenizers

  os.makedirs(path, exist_ok=True)
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(_WORDS)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(["<s>", "</s>", "<|user|>", "<|assistant|>"])
  tok.save(os.path.join(path, "tokenizer.json"))
  config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": 2}, f)
  with open(os.path.join(path, _TEMPLATE_FILE), "w") as f:
    f.write(_GOOD_TEMPLATE)


def _write_tiny_gguf(file: str) -> None:
  """A complete tiny llama GGUF (one layer, byte-level BPE vocabulary) that converts cleanly."""
  import gguf

  from knitjax.models.gguf import _bytes_to_unicode

  d, ffn, heads, vocab = 8, 16, 2, 257  # the 256 bytes and one merge
  w = gguf.GGUFWriter(file, "llama")
  w.add_context_length(64)
  w.add_embedding_length(d)
  w.add_block_count(1)
  w.add_feed_forward_length(ffn)
  w.add_head_count(heads)
  w.add_head_count_kv(heads)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("smollm")
  spelling = _bytes_to_unicode()
  w.add_token_list([spelling[b] for b in range(256)] + ["ab"])
  w.add_token_types([1] * vocab)
  w.add_token_merges(["a b"])
  w.add_bos_token_id(0)
  w.add_eos_token_id(1)
  rng = np.random.default_rng(0)

  def add(name, *shape):
    w.add_tensor(name, rng.normal(size=shape).astype(np.float32))

  add("token_embd.weight", vocab, d)
  add("output_norm.weight", d)
  for name, shape in {
    "attn_norm": (d,),
    "ffn_norm": (d,),
    "attn_q": (d, d),
    "attn_k": (d, d),
    "attn_v": (d, d),
    "attn_output": (d, d),
    "ffn_gate": (ffn, d),
    "ffn_up": (ffn, d),
    "ffn_down": (d, ffn),
  }.items():
    add(f"blk.0.{name}.weight", *shape)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def _render(path: str) -> str:
  from knitjax.models.hf_tokenizer import HFTokenizer

  return HFTokenizer.from_folder(path).apply_chat_template(_MESSAGES)


def context(folder: str) -> dict:
  from knitjax.models import gguf

  pristine = os.path.join(folder, "pristine")
  shutil.rmtree(pristine, ignore_errors=True)
  _write_tokenizer_folder(pristine)
  baseline(f"tokenizer folder {pristine}", lambda: _render(pristine))
  gguf_file = os.path.join(folder, "tiny.gguf")
  _write_tiny_gguf(gguf_file)
  converted = os.path.join(folder, "converted")
  shutil.rmtree(converted, ignore_errors=True)
  baseline(f"GGUF {gguf_file}", lambda: gguf.convert_gguf(gguf_file, converted))
  with open(gguf_file, "rb") as f:
    blob = f.read()
  return {"folder": folder, "pristine": pristine, "gguf": blob, "n": 0, "last": None}


def _template_input(ctx: dict, what: str, template: str) -> BadInput:
  path = fresh_copy(ctx)
  with open(os.path.join(path, _TEMPLATE_FILE), "w") as f:
    f.write(template)
  return BadInput(
    f"{_TEMPLATE_FILE} {what}: {template[:200]}",
    (_TEMPLATE_FILE,),
    lambda: _render(path),
    timeout_s=TIMEOUT_S,
  )


def _template_raises(draw: Draw, ctx: dict) -> BadInput:
  expr = draw(
    st.sampled_from(
      [
        "1/0",
        "1 // 0",
        "1 % 0",
        "'a' + 1",
        "[] | first | int + none",
        "(messages | list)[10**6]['role']",
        "'%d' % 'x'",
        "'{} {}'.format(1)",
        "dict(a=1)['b']['c']",
        "range(1, 10, 0)",
        "'x'.encode('no-such-codec')",
      ]
    )
  )
  prefix = draw(st.sampled_from(["", "{% for m in messages %}{{ m['content'] }}{% endfor %}"]))
  return _template_input(ctx, "raises", f"{prefix}{{{{ {expr} }}}}")


def _template_recursion(draw: Draw, ctx: dict) -> BadInput:
  template = draw(
    st.sampled_from(
      [
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{% macro f(n) %}x{{ f(n) }}{{ f(n) }}{% endmacro %}{{ f(0) }}",
        "{% for m in [messages] recursive %}{{ loop([m]) }}{% endfor %}",
        "{% macro a() %}{{ b() }}{% endmacro %}{% macro b() %}{{ a() }}{% endmacro %}{{ a() }}",
      ]
    )
  )
  return _template_input(ctx, "recurses without end", template)


def _template_loops(draw: Draw, ctx: dict) -> BadInput:
  outer = draw(st.sampled_from([10**3, 10**4, 10**5]))
  inner = draw(st.sampled_from([10**4, 10**5, 10**6]))
  single = draw(st.sampled_from([10**8, 10**9, 10**12]))
  loop = "{%% for %s in range(%d) %%}%s{%% endfor %%}"
  nested = lambda body: loop % ("i", outer, loop % ("j", inner, body))
  template = draw(
    st.sampled_from(
      [
        nested("x"),
        f"{{% for i in range({single}) %}}{{% endfor %}}done",
        nested(""),
        f"{{{{ range({single}) | list | length }}}}",
        f"{{{{ range({single}) | sum }}}}",
      ]
    )
  )
  return _template_input(ctx, "loops without bound", template)


def _template_explodes(draw: Draw, ctx: dict) -> BadInput:
  n = draw(st.sampled_from([10**8, 10**9, 10**10, 10**12]))
  template = draw(
    st.sampled_from(
      [
        f"{{{{ 'x' * {n} }}}}",
        f"{{{{ [0] * {n} }}}}",
        f"{{% set s = 'x' * 100000 %}}{{{{ s * {n // 100000} }}}}",
        f"{{{{ 'x' * 10000 | center({n}) }}}}",
        f"{{{{ '%{n}d' % 1 }}}}",
        "{% set s = namespace(t='xx') %}"
        "{% for i in range(64) %}{% set s.t = s.t ~ s.t %}{% endfor %}{{ s.t | length }}",
      ]
    )
  )
  return _template_input(ctx, "builds a huge value", template)


def _template_empty(draw: Draw, ctx: dict) -> BadInput:
  template = draw(
    st.sampled_from(
      ["", "{# nothing #}", "{% if false %}x{% endif %}", "{% for m in [] %}{{ m }}{% endfor %}"]
    )
  )
  return _template_input(ctx, "renders nothing", template)


def _stop_ids(draw: Draw, ctx: dict) -> BadInput:
  """``eos_token_id`` in generation_config.json or config.json that is not an id of the vocab."""
  path = fresh_copy(ctx)
  file = draw(st.sampled_from(["generation_config.json", "config.json"]))
  bad = st.one_of(
    st.integers(len(_WORDS), 10**13),
    st.integers(max_value=-1),
    st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**100]),
  )
  value = draw(st.one_of(bad, st.lists(bad, min_size=1, max_size=3)))
  with open(os.path.join(path, file), "w") as f:
    json.dump({"eos_token_id": value}, f)
  return BadInput(
    f"{file} eos_token_id={value!r}",
    (file, "eos_token_id"),
    lambda: _render(path),
    timeout_s=TIMEOUT_S,
  )


def _gguf_counts(draw: Draw, ctx: dict) -> BadInput:
  """A GGUF whose tensor count, metadata count or a string length is far beyond the file."""
  from knitjax.models import gguf

  ctx["n"] += 1
  file = os.path.join(ctx["folder"], f"example_{ctx['n']}.gguf")
  if ctx["last"]:
    shutil.rmtree(ctx["last"], ignore_errors=True)
  ctx["last"] = out = os.path.join(ctx["folder"], f"example_{ctx['n']}")
  blob = bytearray(ctx["gguf"])
  # header: magic (4), version (u32), tensor count (u64 at 8), metadata count (u64 at 16), then
  # the first key: its length (u64 at 24)
  offset, what = draw(
    st.sampled_from([(8, "tensor count"), (16, "metadata count"), (24, "first key length")])
  )
  value = draw(st.one_of(st.integers(10**4, 2**64 - 1), st.sampled_from([2**32, 2**63, 2**64 - 1])))
  blob[offset : offset + 8] = value.to_bytes(8, "little")
  with open(file, "wb") as f:
    f.write(bytes(blob))
  name = os.path.basename(file)
  return BadInput(
    f"GGUF {what} = {value}", (name,), lambda: gguf.convert_gguf(file, out), timeout_s=TIMEOUT_S
  )


CASES: list[Case] = [
  ("template_raises", _template_raises),
  ("template_recursion", _template_recursion),
  ("template_loops", _template_loops),
  ("template_explodes", _template_explodes),
  ("template_empty", _template_empty),
  ("stop_ids", _stop_ids),
  ("gguf_counts", _gguf_counts),
]
