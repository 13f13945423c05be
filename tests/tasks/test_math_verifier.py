"""Tests for knitjax.tasks.math_verifier: numbers read from text, answers, and the rewards."""

import json
from fractions import Fraction

import numpy as np
import pytest

from knitjax.tasks import gsm8k, math_verifier
from tests.tasks.test_gsm8k import RECORDS, FakeChatTokenizer


@pytest.fixture
def path(tmp_path):
  """The GSM8K file of test_gsm8k: its first prompt's answer is 7."""
  path = tmp_path / "data.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
  return str(path)


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
  got = math_verifier.last_number(text)
  if want is None:
    assert got is None
  else:
    assert isinstance(got, Fraction) and got == want


def test_last_number_values_compare_exactly():
  last_number = math_verifier.last_number
  assert last_number("0.75") == last_number("3/4")
  assert last_number("1e5") == last_number("100,000")
  assert last_number("0.1") + last_number("0.2") == last_number("0.3")
  assert last_number("1/3") != last_number("0.3333333333333333")


# ---- rewards: answer extraction, format, combined, several stop ids --------------------------


@pytest.mark.parametrize(
  "text, want",
  [
    ("4 + 3 = 7\n#### 7", 7),
    ("#### 7\nQuestion: Tom has 3 apples", 7),  # the marker wins over the last number
    ("####-5 degrees", -5),
    ("#### $1,234.", 1234),
    ("so 3 + 4 = 7", 7),  # no marker: the last number
    ("#### none, but 9", 9),  # the first number after the marker
    ("####", None),
    ("it is 8 ####", 8),  # a marker with no number after it: the last number
  ],
)
def test_answer_number(text, want):
  assert math_verifier.answer_number(text) == (None if want is None else Fraction(want))


@pytest.mark.parametrize(
  "completion, numeric, fmt",
  [
    ("3 + 4 = 7.\n#### 7<|im_end|>", 1.0, 1.0),
    ("3 + 4 = 7.\n#### 7<eos>", 1.0, 1.0),  # either stop id ends the completion
    ("#### 7.<|im_end|>#### 8", 1.0, 1.0),  # text after the stop id is ignored
    ("3 + 4 = 7.\n#### 7", 1.0, 0.0),  # no stop id: right, but not finished
    ("Tom has 7 apples.<|im_end|>", 1.0, 0.0),  # last-number fallback, no answer line
    ("#### 7\nQuestion: 5 more?<|im_end|>", 1.0, 1.0),
    ("#### 7 apples<|im_end|>", 1.0, 0.0),  # the answer line holds more than the number
    ("#### 7\n#### 8<|im_end|>", 1.0, 0.0),  # two answer lines
    ("3 + 5 = 8\n#### 8<|im_end|>", 0.0, 1.0),  # wrong, well formed
    ("#### 8\nso 7<eos>", 0.0, 1.0),  # the marker wins over the last number
    ("no idea<|im_end|>", 0.0, 0.0),
  ],
)
def test_rewards_with_several_stop_ids(path, completion, numeric, fmt):
  tok = FakeChatTokenizer()
  p = gsm8k.load_examples(path, tok)[0]  # answer 7
  ids = np.array(tok.encode(completion.replace("<eos>", "\x00"), bos=False), np.int32)
  ids[ids == 5] = tok.eos_id  # "\x00" stands for the plain EOS id
  assert math_verifier.numeric_match_reward(p, ids, tok) == numeric
  assert math_verifier.format_reward(p, ids, tok) == fmt
  assert math_verifier.math_reward(p, ids, tok) == pytest.approx(numeric + 0.1 * fmt)
  assert math_verifier.math_reward(p, ids, tok, format_weight=0.5) == pytest.approx(
    numeric + 0.5 * fmt
  )


def test_rewards_with_the_char_tokenizer(path):
  tok = gsm8k.make_tokenizer()
  p = gsm8k.load_examples(path, tok)[0]  # answer 7

  def ids(text, eos=True):
    return np.array(tok.encode(text, bos=False) + [tok.eos_id] * eos, np.int32)

  assert math_verifier.math_reward(p, ids(" 3 + 4 = 7\n#### 7"), tok) == pytest.approx(1.1)
  assert math_verifier.math_reward(p, ids(" 3 + 4 = 7\n#### 7", eos=False), tok) == 1.0
  assert math_verifier.math_reward(p, ids(" #### 9"), tok) == pytest.approx(0.1)
  assert math_verifier.math_reward(p, ids(" 7"), tok) == 1.0
  padded = np.concatenate([ids("#### 7"), np.zeros(5, np.int32)])  # the padded buffer form
  assert math_verifier.format_reward(p, padded, tok) == 1.0
