"""Tests for knitjax.tasks.gsm8k (each test writes its own small JSONL file)."""

import json

import numpy as np
import pytest

from knitjax.tasks import gsm8k
from knitjax.tasks.registry import make_prompt_source
from knitjax.tasks.rewards import get_reward_fn

RECORDS = [
  {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
  {"question": "A car costs $1,200 more than $34. Cost?", "answer": "1200+34=1234\n#### 1,234"},
  {"question": "It is 2 degrees; it drops 7. Now?", "answer": "#### -5"},
  {"question": "Half of 7?", "answer": "#### 3.50"},
]


def _write(tmp_path, lines):
  path = tmp_path / "data.jsonl"
  path.write_text("\n".join(lines) + "\n")
  return str(path)


@pytest.fixture
def path(tmp_path):
  return _write(tmp_path, [json.dumps(r) for r in RECORDS])


def test_load(path):
  tok = gsm8k.make_tokenizer()
  examples = gsm8k.load_examples(path, tok)
  assert [p.answer for p in examples] == ["7", "1234", "-5", "3.50"]
  assert [p.prompt_id for p in examples] == [0, 1, 2, 3]
  p = examples[1]
  assert p.text == "Question: A car costs $1,200 more than $34. Cost?\nAnswer:"
  assert p.cls == "gsm8k" and p.tokens[0] == tok.bos_id and tok.decode(p.tokens) == p.text
  src, tok2 = make_prompt_source("gsm8k", seed=0, path=path)
  assert tok2.vocab_size == 99 and sorted(q.prompt_id for q in src.next(4)) == [0, 1, 2, 3]


def test_last_number():
  cases = {
    "so 1,234 dollars.": "1234",
    "x = -5": "-5",
    "3 then 3.50": "3.50",
    "it is 18.": "18",
    "12,34": "34",
    "none": None,
    ".5 of it": "0.5",
  }
  for text, want in cases.items():
    got = gsm8k.last_number(text)
    assert got is None if want is None else got == gsm8k.decimal.Decimal(want), text


def test_numeric_match(path):
  tok = gsm8k.make_tokenizer()
  ex = gsm8k.load_examples(path, tok)
  fn = get_reward_fn("numeric_match")

  def score(p, text, tail=()):
    return fn(p, np.array(tok.encode(text, bos=False) + list(tail), np.int32), tok)

  assert score(ex[0], " 3 + 4 = 7") == 1.0
  assert score(ex[0], " 7 apples, not 8") == 0.0  # the last number counts
  assert score(ex[1], " The answer is 1,234.") == 1.0
  assert score(ex[1], " 1234") == 1.0
  assert score(ex[2], " it is -5 degrees") == 1.0
  assert score(ex[2], " it is 5 degrees") == 0.0
  assert score(ex[3], " 3.5") == 1.0
  assert score(ex[3], " no idea") == 0.0
  # Text after EOS is ignored; EOS is not required.
  eos = tok.eos_id
  assert score(ex[0], " 7", tail=[eos, *tok.encode(" 9", bos=False)]) == 1.0
  assert score(ex[0], " 9", tail=[eos, *tok.encode(" 7", bos=False)]) == 0.0


@pytest.mark.parametrize(
  "lines, match",
  [
    (['{"question": "q", "answer": "#### 1"}', "{not json"], r"data.jsonl:2: invalid JSON"),
    (['{"question": "q"}'], r"data.jsonl:1: field 'answer' is missing"),
    (['{"question": 3, "answer": "#### 1"}'], r"data.jsonl:1: field 'question'"),
    (['{"question": "q", "answer": "7"}'], r"data.jsonl:1: answer must end in '#### <number>'"),
    (['{"question": "q", "answer": "#### seven"}'], r"data.jsonl:1: answer must end"),
    (['{"question": "caf\\u00e9?", "answer": "#### 1"}'], r"data.jsonl:1: character"),
    (["[1, 2]"], r"data.jsonl:1: expected a JSON object"),
    ([""], r"holds no examples"),
  ],
)
def test_load_errors(tmp_path, lines, match):
  path = _write(tmp_path, lines)
  with pytest.raises(ValueError, match=match):
    gsm8k.load_examples(path, gsm8k.make_tokenizer())


def test_missing_file(tmp_path):
  with pytest.raises(ValueError, match="nope.jsonl.*does not exist"):
    make_prompt_source("gsm8k", seed=0, path=str(tmp_path / "nope.jsonl"))


def test_blank_lines_skipped(tmp_path):
  path = _write(tmp_path, ["", json.dumps(RECORDS[0]), "   ", json.dumps(RECORDS[2])])
  assert len(gsm8k.load_examples(path, gsm8k.make_tokenizer())) == 2
