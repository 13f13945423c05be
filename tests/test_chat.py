"""knitjax.chat: budgets the model's positions cannot hold are one sentence, before any work."""

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from knitjax import chat

LLAMA = Path(__file__).parent / "models" / "data" / "hf_llama"  # 128 positions, vocab 64


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  """The tiny Llama checkpoint with a character-level tokenizer and a chat template."""
  folder = tmp_path_factory.mktemp("chat")
  for name in ("config.json", "model.safetensors"):
    shutil.copy(LLAMA / name, folder / name)
  chars = "abcdefghijklmnopqrstuvwxyz ?.,0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:60]
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
  Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")).save(
    str(folder / "tokenizer.json")
  )
  template = "{% for m in messages %}<s>{{ m.content }}{% endfor %}"
  config = dict(eos_token="</s>", bos_token="<s>", unk_token="<unk>", chat_template=template)
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  return str(folder)


@pytest.mark.parametrize("n", [0, 128, 1000, 10**9])
def test_max_new_tokens_beyond_the_positions_is_one_sentence(folder, n):
  with pytest.raises(
    ValueError,
    match=rf"^max_new_tokens={n} is not accepted; it must be in \[1, 127\]: the model has 128 "
    r"positions \(max_position_embeddings in .*config.json\), one at least for the prompt\.$",
  ):
    chat.chat_table(folder, ["hi"], max_new_tokens=n)


def test_a_100_kb_prompt_is_refused_before_it_is_rendered(folder, monkeypatch):
  from knitjax.models import hf_tokenizer

  rendered = []
  monkeypatch.setattr(
    hf_tokenizer.HFTokenizer, "apply_chat_template", lambda *a, **k: rendered.append(1)
  )
  with pytest.raises(
    ValueError,
    match=r"^prompt 2 has 100,000 characters, more than the model's 128 positions "
    r"\(max_position_embeddings in .*config.json\) can hold at 256 characters a token\.$",
  ):
    chat.chat_table(folder, ["hi", "a" * 100_000], max_new_tokens=4)
  assert not rendered


def test_a_prompt_past_the_positions_is_refused_before_the_model_loads(folder, monkeypatch):
  from knitjax.models import hf

  monkeypatch.setattr(hf, "init_from_hf", lambda *a, **k: pytest.fail("the model was loaded"))
  with pytest.raises(
    ValueError,
    match=r"^a prompt of 203 tokens and max_new_tokens=4 pass the model's 128 positions "
    r"\(max_position_embeddings in .*config.json\); shorten the prompt or lower max_new_tokens\.$",
  ):
    chat.chat_table(folder, ["a" * 200], max_new_tokens=4)


def test_a_budget_that_fits_is_answered(folder):
  table = chat.chat_table(
    folder, ["a" * 100], max_new_tokens=25
  )  # "<s>" + 100 = 103 tokens, + 25 = 128
  assert "| " + "a" * 100 + " |" in table
