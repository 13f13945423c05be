"""Tests for knitjax.tasks.gsm8k (each test writes its own small JSONL file)."""

import dataclasses
import json
from fractions import Fraction

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


def test_answer_notations(tmp_path):
  answers = ["#### 1e5", "#### 3/4", "#### $1,000", "#### 42.", "#### -2.5E-3"]
  lines = [json.dumps({"question": "q", "answer": a}) for a in answers]
  tok = gsm8k.make_tokenizer()
  examples = gsm8k.load_examples(_write(tmp_path, lines), tok)
  assert [p.answer for p in examples] == ["1e5", "3/4", "1000", "42", "-2.5E-3"]
  fn = get_reward_fn("numeric_match")
  for p, completion in zip(examples, ["100000", "0.75", "1000", "42", "-1/400"], strict=True):
    assert fn(p, np.array(tok.encode(completion, bos=False), np.int32), tok) == 1.0, p.answer


def test_reward_accepts_ids_beyond_the_tokenizer_vocab(path):
  """Regression: a model vocab larger than the tokenizer's (init_from) crashed the reward."""
  tok = gsm8k.make_tokenizer()
  p = gsm8k.load_examples(path, tok)[0]  # answer 7
  fn = get_reward_fn("numeric_match")
  model_vocab = 32_000
  rng = np.random.default_rng(0)
  for _ in range(20):
    ids = rng.integers(tok.vocab_size, model_vocab, size=16)
    assert fn(p, ids, tok) == 0.0
  seven, one, two = (tok.encode(c, bos=False)[0] for c in "712")
  oov = model_vocab - 1
  assert fn(p, np.array([oov, seven, oov]), tok) == 1.0
  assert fn(p, np.array([seven, oov, tok.eos_id]), tok) == 1.0
  # An unknown id separates digits rather than vanishing: "7<?>12" does not read as 712.
  p712 = dataclasses.replace(p, answer="712")
  assert fn(p712, np.array([seven, oov, one, two]), tok) == 0.0
  assert fn(p712, np.array([seven, one, two]), tok) == 1.0


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


@pytest.mark.parametrize(
  "text, want",
  [
    ("42", 42),
    ("so 1,234 dollars.", 1234),
    ("x = -5", -5),
    ("-3", -3),
    ("it drops to -3.5 degrees", Fraction(-7, 2)),
    ("3 then 3.50", Fraction(7, 2)),
    (".5 of it", Fraction(1, 2)),
    ("it is 18.", 18),
    ("The answer is 42.", 42),
    ("1,000", 1000),
    ("1,000,000 people", 1_000_000),
    ("1,234.5", Fraction(2469, 2)),
    ("1,2", 2),  # not a thousands number: the numbers 1 and 2
    ("12,34", 34),
    ("1,0000", 0),
    ("#### 1e5", 100_000),
    ("2.5E-3", Fraction(1, 400)),
    ("-1e-2", Fraction(-1, 100)),
    ("3/4", Fraction(3, 4)),
    ("-3/4 of a cup", Fraction(-3, 4)),
    ("1,000/4", 250),
    ("$1,000", 1000),
    ("it costs -$5", -5),
    ("10-5", 5),  # the minus joins two terms
    ("5 - 3 = 2", 2),
    ("3 eggs each", 3),
    ("1/0", None),
    ("1e99999", None),  # beyond 10**1000: no answer
    ("none", None),
    ("", None),
    ("no digits, just $ and e", None),
  ],
)
def test_last_number(text, want):
  got = gsm8k.last_number(text)
  if want is None:
    assert got is None
  else:
    assert isinstance(got, Fraction) and got == want


def test_last_number_values_compare_exactly():
  assert gsm8k.last_number("0.75") == gsm8k.last_number("3/4")
  assert gsm8k.last_number("1e5") == gsm8k.last_number("100,000")
  assert gsm8k.last_number("0.1") + gsm8k.last_number("0.2") == gsm8k.last_number("0.3")
  assert gsm8k.last_number("1/3") != gsm8k.last_number("0.3333333333333333")


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
  assert score(ex[3], " 7/2") == 1.0  # values compare exactly, whatever the notation
  assert score(ex[3], " 3.5e0") == 1.0
  assert score(ex[1], " 1.234e3") == 1.0
  assert score(ex[1], " $1,234.") == 1.0
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
    (['{"answer": "#### 1"}'], r"data.jsonl:1: field 'question' is missing"),
    (['{"question": "q", "answer": null}'], r"data.jsonl:1: field 'answer' is missing or not"),
    (['{"question": ["q"], "answer": "#### 1"}'], r"data.jsonl:1: field 'question'"),
    (['{"question": "q", "answer": "#### 1/0"}'], r"data.jsonl:1: answer must end"),
    (['{"question": "q", "answer": "#### 1e5000"}'], r"data.jsonl:1: answer must end"),
    (['{"question": "q", "answer": "#### 1"}', '"just a string"'], r"data.jsonl:2: expected"),
    (['{"question": "q", "answer": "#### 1"}', '{"question": 1' + "0" * 5000 + "}"], r":2: inv"),
    (["[" * 100_000 + "]" * 100_000], r"data.jsonl:1: invalid JSON"),
    ([""], r"holds no examples"),
    (["", "  ", ""], r"holds no examples"),
  ],
)
def test_load_errors(tmp_path, lines, match):
  path = _write(tmp_path, lines)
  with pytest.raises(ValueError, match=match):
    gsm8k.load_examples(path, gsm8k.make_tokenizer())


def test_empty_file(tmp_path):
  path = tmp_path / "empty.jsonl"
  path.write_bytes(b"")
  with pytest.raises(ValueError, match=r"empty.jsonl' holds no examples"):
    gsm8k.load_examples(str(path), gsm8k.make_tokenizer())


def test_not_utf8(tmp_path):
  path = tmp_path / "latin1.jsonl"
  good = json.dumps(RECORDS[0]).encode()
  path.write_bytes(good + b"\n" + '{"question": "caf\xe9", "answer": "#### 1"}'.encode("latin-1"))
  with pytest.raises(ValueError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 17"):
    gsm8k.load_examples(str(path), gsm8k.make_tokenizer())


def test_utf8_byte_order_mark_is_accepted(tmp_path):
  path = tmp_path / "bom.jsonl"
  path.write_bytes(b"\xef\xbb\xbf" + json.dumps(RECORDS[0]).encode() + b"\r\n")
  assert [p.answer for p in gsm8k.load_examples(str(path), gsm8k.make_tokenizer())] == ["7"]


def test_prompt_length_limit(tmp_path):
  tok = gsm8k.make_tokenizer()
  overhead = len(gsm8k.TEMPLATE.format(question="")) + 1  # template and BOS
  fits = json.dumps({"question": "x" * (32 - overhead), "answer": "#### 1"})
  over = json.dumps({"question": "x" * (33 - overhead), "answer": "#### 1"})
  examples = gsm8k.load_examples(_write(tmp_path, [fits]), tok, max_prompt_tokens=32)
  assert len(examples[0].tokens) == 32
  path = _write(tmp_path, [fits, over])
  with pytest.raises(
    ValueError, match=r"data.jsonl:2: the prompt is 33 tokens long, over the limit of 32 "
  ):
    gsm8k.load_examples(path, tok, max_prompt_tokens=32)
  # The limit reaches the task through the registry, and the default is MAX_PROMPT_TOKENS.
  with pytest.raises(ValueError, match=r"over the limit of 32"):
    make_prompt_source("gsm8k", seed=0, path=path, max_prompt_tokens=32)
  source, _ = make_prompt_source("gsm8k", seed=0, path=path)
  assert source.num_examples == 2 and gsm8k.MAX_PROMPT_TOKENS == 4096


def test_huge_question_is_rejected_without_tokenizing_it(tmp_path):
  """A 10 MB question used to become a 10M-token prompt_len for every prompt buffer."""
  huge = json.dumps({"question": "7" * 10_000_000, "answer": "#### 1"})
  path = _write(tmp_path, [json.dumps(RECORDS[0]), huge])
  tok = gsm8k.make_tokenizer()
  encoded = []
  encode = tok.encode
  tok.encode = lambda text, **kw: encoded.append(len(text)) or encode(text, **kw)
  with pytest.raises(ValueError, match=r"data.jsonl:2: the prompt is 10000019 tokens long, over"):
    gsm8k.load_examples(path, tok)
  assert max(encoded) < 100  # the length is checked before the question is encoded


@pytest.mark.parametrize("bad", [0, -1, 2.5, "64", True])
def test_max_prompt_tokens_must_be_a_positive_int(path, bad):
  with pytest.raises(ValueError, match=r"max_prompt_tokens must be an integer >= 1"):
    gsm8k.load_examples(path, gsm8k.make_tokenizer(), max_prompt_tokens=bad)


def test_missing_file(tmp_path):
  with pytest.raises(ValueError, match="nope.jsonl.*does not exist"):
    make_prompt_source("gsm8k", seed=0, path=str(tmp_path / "nope.jsonl"))
  with pytest.raises(ValueError, match="is not a regular file"):
    gsm8k.load_examples(str(tmp_path), gsm8k.make_tokenizer())


def test_blank_lines_skipped(tmp_path):
  path = _write(tmp_path, ["", json.dumps(RECORDS[0]), "   ", json.dumps(RECORDS[2])])
  assert len(gsm8k.load_examples(path, gsm8k.make_tokenizer())) == 2
