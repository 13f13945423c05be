"""Tests for knitjax.tasks.word_problems (generated GSM8K-format word problems)."""

import re
from fractions import Fraction

import pytest

from knitjax.tasks import gsm8k, word_problems

# A step is "<arithmetic> = <integer>" inside a sentence: "The pens cost 4 * 3 = 12 dollars."
_STEP_RE = re.compile(r"(\d[\d +\-*/()]*?) = (\d+)")
# Constants a solution may use without reading them from the question.
_CONSTANTS = {2, 4, 7, 12, 60, 100, 1000}


def _eval(expr: str) -> Fraction:
  """Exact value of an arithmetic expression of integers, + - * / and parentheses."""
  assert set(expr) <= set("0123456789 +-*/()"), expr
  return eval(re.sub(r"(\d+)", r"Fraction(\1)", expr), {"Fraction": Fraction})


def _answer(record: dict) -> int:
  return int(record["answer"].rpartition("#### ")[2])


def test_generate_is_deterministic_for_a_seed():
  a = word_problems.generate(300, seed=7)
  assert a == word_problems.generate(300, seed=7)
  assert a != word_problems.generate(300, seed=8)
  assert word_problems.generate(100, seed=7) == a[:100]  # a longer draw extends a shorter one
  assert len({r["question"] for r in a}) == 300
  train, heldout = word_problems.splits(seed=3, train=200, heldout=50)
  assert (train, heldout) == word_problems.splits(seed=3, train=200, heldout=50)


def test_splits_share_no_question():
  train, heldout = word_problems.splits(seed=0, train=3000, heldout=600)
  train_q, heldout_q = {r["question"] for r in train}, {r["question"] for r in heldout}
  assert (len(train_q), len(heldout_q)) == (3000, 600)  # distinct within each split too
  assert not train_q & heldout_q
  # The training set does not depend on the held-out size.
  assert word_problems.splits(seed=0, train=3000, heldout=10)[0] == train
  # The held-out set uses the same templates: some held-out questions differ from a training
  # question only in their numbers.
  shapes = {re.sub(r"\d+", "N", q) for q in train_q}
  assert sum(re.sub(r"\d+", "N", q) in shapes for q in heldout_q) > 300


def test_fixed_split_is_the_generated_task_data():
  train, heldout = word_problems.fixed_split("train"), word_problems.fixed_split("heldout")
  assert (len(train), len(heldout)) == (word_problems.TRAIN_SIZE, word_problems.HELDOUT_SIZE)
  assert (train, heldout) == word_problems.splits(
    seed=word_problems.DATA_SEED, train=len(train), heldout=len(heldout)
  )
  with pytest.raises(ValueError, match=r"unknown generated split 'test'; choose one of: train, "):
    word_problems.fixed_split("test")


def test_every_step_is_right_and_grounded():
  """Each step's arithmetic holds, uses only numbers the question or earlier steps give, and the
  last step's result is the answer."""
  records = word_problems.generate(3000, seed=1)
  for r in records:
    body, sep, final = r["answer"].rpartition("\n#### ")
    assert sep and re.fullmatch(r"\d+", final), r
    steps = body.split("\n")
    assert 1 <= len(steps) <= 3, r
    known = {int(n) for n in re.findall(r"\d+", r["question"])} | _CONSTANTS
    result = None
    for step in steps:
      (match,) = _STEP_RE.findall(step)  # one equation a step
      expr, result = match[0], int(match[1])
      assert _eval(expr) == result, (step, r)
      assert {int(n) for n in re.findall(r"\d+", expr)} <= known, (step, r)
      known.add(result)
    assert result == _answer(r) >= 0, r


@pytest.mark.parametrize(
  "pattern, solve",
  [
    # Recomputed by hand from the question text, independently of the worked solution.
    (
      r"buys (\d+) [a-z ]+ for \$(\d+) each and pays with a \$(\d+) bill",
      lambda k, p, b: b - k * p,
    ),
    (r"has (\d+) cows and (\d+) hens", lambda c, h: 4 * c + 2 * h),
    (r"costs \$(\d+)\. It is on sale for (\d+)% off", lambda p, pct: p - p * pct // 100),
    (r"is (\d+) hours and (\d+) minutes long", lambda h, m: 60 * h + m),
    (r"(\d+) feet long and (\d+) feet wide", lambda length, w: 2 * (length + w)),
    (r"buys (\d+) dozen eggs and uses (\d+)", lambda d, u: 12 * d - u),
    (r"costs \$(\d+)\. \w+ has saved \$(\d+) and saves \$(\d+)", lambda c, s, w: (c - s) // w),
  ],
)
def test_answers_recomputed_by_hand(pattern, solve):
  found = 0
  for r in word_problems.generate(2000, seed=5):
    m = re.search(pattern, r["question"])
    if m:
      found += 1
      assert solve(*map(int, m.groups())) == _answer(r), r
  assert found >= 10


def test_first_records_of_a_seed_are_pinned():
  """A change here changes every seed's data (and the generated task's prompts)."""
  assert word_problems.generate(2, seed=0) == [
    {
      "question": "A movie is 2 hours and 30 minutes long. How many minutes long is the movie?",
      "answer": "2 hours are 2 * 60 = 120 minutes.\nThe movie is 120 + 30 = 150 minutes long.\n"
      "#### 150",
    },
    {
      "question": "Mei has 8 marbles. She keeps 2 for herself and shares the rest equally among 2 "
      "friends. How many marbles does each friend get?",
      "answer": "She shares 8 - 2 = 6 marbles.\nEach friend gets 6 / 2 = 3 marbles.\n#### 3",
    },
  ]


def test_text_is_printable_ascii_and_reads_as_gsm8k(tmp_path):
  records = word_problems.generate(500, seed=2)
  assert all(set(r["question"] + r["answer"]) <= set(gsm8k.ALPHABET) for r in records)
  path = tmp_path / "wp.jsonl"
  word_problems.write_jsonl(path, records)
  examples = gsm8k.load_examples(str(path), gsm8k.make_tokenizer())
  assert [p.answer for p in examples] == [str(_answer(r)) for r in records]
  assert examples[0].text == f"Question: {records[0]['question']}\nAnswer:"


@pytest.mark.parametrize("bad", [-1, 2.0, True, "3"])
def test_counts_must_be_non_negative_ints(bad):
  with pytest.raises(ValueError, match=r"n must be an integer >= 0"):
    word_problems.generate(bad, seed=0)
  with pytest.raises(ValueError, match=r"heldout must be an integer >= 0"):
    word_problems.splits(seed=0, train=1, heldout=bad)
