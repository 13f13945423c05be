"""Tests for knitjax.tasks.word_problems (generated GSM8K-format word problems)."""

import re
from fractions import Fraction

import pytest

from knitjax.tasks import gsm8k, one_step_templates, word_problems

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
  with pytest.raises(
    ValueError,
    match=r"unknown generated split 'test' of the 'mixed' word problems; choose one of: train, ",
  ):
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


# The one-step family split by template: held-out phrasings that training never sees.


def _words(text: str) -> list[str]:
  """A template's words, slots (``{a}``, ``{item}``) counted as words."""
  return re.findall(r"\{\w+\}|[a-z']+|\$", text.lower())


def _sentences(text: str) -> set[str]:
  return {s.strip().lower() for s in re.split(r"[.?!,]", text) if s.strip()}


def _pattern(text: str) -> re.Pattern:
  """Matches the questions of one template: ``{a}`` and ``{b}`` captured, other slots words."""
  parts = []
  for piece in re.split(r"(\{\w+\})", text):
    if piece in ("{a}", "{b}"):
      parts.append(rf"(?P<{piece[1]}>\d+)")
    elif re.fullmatch(r"\{\w+\}", piece):
      parts.append(r"[A-Za-z]+(?: [a-z]+)?")
    else:
      parts.append(re.escape(piece))
  return re.compile("".join(parts))


_OP = {
  "+": lambda a, b: a + b,
  "-": lambda a, b: a - b,
  "*": lambda a, b: a * b,
  "/": lambda a, b: Fraction(a, b),
}


def test_one_step_heldout_phrasings_share_no_wording_with_train():
  train, heldout = one_step_templates.ONE_STEP, one_step_templates.ONE_STEP_HELDOUT
  assert len(train) >= 30 and len(heldout) >= 10
  assert not set(train) & set(heldout)
  for ops in ({t.op for t in train.values()}, {t.op for t in heldout.values()}):
    assert ops == {"+", "-", "*", "/"}
  train_sentences = set().union(*(_sentences(t.text) for t in train.values()))
  train_grams = {
    tuple(w[i : i + 4]) for t in train.values() for w in [_words(t.text)] for i in range(len(w) - 3)
  }
  for name, t in heldout.items():
    assert not _sentences(t.text) & train_sentences, name
    words = _words(t.text)
    shared = {tuple(words[i : i + 4]) for i in range(len(words) - 3)} & train_grams
    assert not shared, (name, shared)  # not a train phrasing with a word swapped
    assert not any(_pattern(o.text).search(t.text) for o in train.values()), name


@pytest.mark.parametrize("split", word_problems.SPLITS)
def test_one_step_splits_keep_to_their_templates_and_answer_exactly(split):
  """Every question of a split is written in one of its templates only (train and heldout: the
  training ones; heldout_phrasings: the held-out ones), and its answer, recomputed from the
  question's two numbers, is a whole number that the record gives."""
  own, other = one_step_templates.ONE_STEP, one_step_templates.ONE_STEP_HELDOUT
  if split == "heldout_phrasings":
    own, other = other, own
  patterns = {name: _pattern(t.text) for name, t in own.items()}
  others = [_pattern(t.text) for t in other.values()]
  records = word_problems.fixed_split(split, "one_step")
  assert len(records) == (word_problems.TRAIN_SIZE if split == "train" else 512)
  used = set()
  for r in records:
    (name,) = [n for n, p in patterns.items() if p.fullmatch(r["question"])]
    assert not any(p.fullmatch(r["question"]) for p in others), r
    used.add(name)
    m = patterns[name].fullmatch(r["question"])
    value = _OP[own[name].op](int(m["a"]), int(m["b"]))
    assert value == int(value) >= 0 and int(value) == _answer(r), r
    assert r["answer"].startswith(f"{m['a']} {own[name].op} {m['b']} = {_answer(r)}"), r
  assert used == set(own)  # every template is drawn


def test_one_step_phrasing_split_is_deterministic_and_apart():
  a = word_problems.heldout_phrasings(seed=4, n=100)
  assert (
    a
    == word_problems.heldout_phrasings(seed=4, n=100)
    != word_problems.heldout_phrasings(seed=5, n=100)
  )
  assert word_problems.heldout_phrasings(seed=4, n=30) == a[:30]
  train, _ = word_problems.splits(seed=4, train=500, heldout=50, family="one_step")
  assert not {r["question"] for r in train} & {r["question"] for r in a}
  assert word_problems.fixed_split("heldout_phrasings", "one_step") == (
    word_problems.heldout_phrasings(seed=word_problems.DATA_SEED, n=word_problems.HELDOUT_SIZE)
  )


def test_only_a_family_with_heldout_phrasings_has_that_split():
  assert word_problems.splits_of("one_step") == ("train", "heldout", "heldout_phrasings")
  assert word_problems.splits_of("mixed") == ("train", "heldout")
  with pytest.raises(ValueError, match=r"unknown generated split 'heldout_phrasings' of the "):
    word_problems.fixed_split("heldout_phrasings", "mixed")
  with pytest.raises(ValueError, match=r"'mixed' word problems have no held-out phrasings"):
    word_problems.heldout_phrasings(seed=0, n=3, family="mixed")
  path = "generated:one_step:heldout_phrasings"
  assert gsm8k.generated_path(path) == ("one_step", "heldout_phrasings")
  with pytest.raises(ValueError, match=r"unknown generated data .*one_step:heldout_phrasings\."):
    gsm8k.generated_path("generated:mixed:heldout_phrasings")
