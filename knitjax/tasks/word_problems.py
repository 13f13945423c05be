"""Generated grade-school word problems with integer answers, in the GSM8K record format.

Each record is ``{"question": str, "answer": str}`` whose answer is a short worked solution (one
line per step, every step an equation such as ``4 * 3 = 12``) ending in ``#### <integer>``, so
`knitjax.tasks.gsm8k` reads them like GSM8K itself. The templates
(`knitjax.tasks.word_problem_templates`) take 1-3 steps with small numbers: easy enough that a
small instruct model gets some right, so RL has a signal from the first step. Text is printable
ASCII, so the character tokenizer reads it too.

Everything is drawn from a seeded ``numpy.random.Generator``: the same seed gives the same
records. `splits` gives a training set and a held-out set that share no question text (the
held-out set is the same templates with other names and numbers: held-out numbers), and
`heldout_phrasings` a set drawn from templates no split trains on (held-out phrasings: only
families with such templates, `HELDOUT_PHRASINGS`). `fixed_split` is the one set of splits the
``"generated:[<family>:]<split>"`` task paths read (`DATA_SEED`, `TRAIN_SIZE`, `HELDOUT_SIZE`):
``train``, ``heldout`` and ``heldout_phrasings``.
"""

import json
import os
from collections.abc import Iterable

import numpy as np

from knitjax.tasks.one_step_templates import ONE_STEP, ONE_STEP_HELDOUT
from knitjax.tasks.word_problem_draws import Draw
from knitjax.tasks.word_problem_templates import TEMPLATES, Template

# The data of the "generated:<split>" task paths; changing any of these changes those prompts.
DATA_SEED = 20240607
TRAIN_SIZE = 4096
HELDOUT_SIZE = 512
# "heldout": the training templates with other names and numbers; "heldout_phrasings": templates
# never trained on (HELDOUT_SIZE records too).
SPLITS = ("train", "heldout", "heldout_phrasings")
# Template families: "mixed" (1-3 steps, the default) and "one_step" (one operation): the
# templates of "train" and "heldout".
FAMILIES: dict[str, dict[str, Template]] = {"mixed": TEMPLATES, "one_step": ONE_STEP}
# The families' held-out phrasings: the templates of "heldout_phrasings", none of them in FAMILIES.
HELDOUT_PHRASINGS: dict[str, dict[str, Template]] = {"one_step": ONE_STEP_HELDOUT}


def _templates(family: str) -> dict[str, Template]:
  if family not in FAMILIES:
    raise ValueError(
      f"unknown word-problem family {family!r}; choose one of: {', '.join(FAMILIES)}."
    )
  return FAMILIES[family]


def _draw_unique(
  rng: np.random.Generator, n: int, exclude: frozenset[str], templates: dict[str, Template]
) -> list[dict]:
  """Draws ``n`` records with distinct questions, none of them in ``exclude``."""
  draw, names = Draw(rng), list(templates)
  records, seen = [], set(exclude)
  attempts = 0
  while len(records) < n:
    attempts += 1
    if attempts > 100 * n + 1000:  # the templates hold far more questions than any split needs
      raise ValueError(
        f"could draw only {len(records)} distinct word problems of the {n} asked for; "
        "ask for fewer."
      )
    question, steps, answer = templates[names[int(rng.integers(len(names)))]](draw)
    if question in seen:
      continue
    seen.add(question)
    records.append({"question": question, "answer": "\n".join(steps) + f"\n#### {answer}"})
  return records


def _check_count(name: str, n) -> None:
  if isinstance(n, bool) or not isinstance(n, int) or n < 0:
    raise ValueError(f"{name} must be an integer >= 0, got {n!r}.")


def generate(n: int, *, seed: int, family: str = "mixed") -> list[dict]:
  """Returns ``n`` word-problem records with distinct questions; the same seed, the same records."""
  _check_count("n", n)
  return _draw_unique(np.random.default_rng(seed), n, frozenset(), _templates(family))


def splits(
  *, seed: int, train: int, heldout: int, family: str = "mixed"
) -> tuple[list[dict], list[dict]]:
  """Returns (train records, held-out records) with no question text in both.

  The two draw from independent streams of one seed (``SeedSequence(seed).spawn(2)``), so the
  training set does not depend on ``heldout``; held-out draws that repeat a training question are
  redrawn, which makes the held-out set the same templates with other names and numbers.
  """
  _check_count("train", train)
  _check_count("heldout", heldout)
  templates = _templates(family)
  train_seq, heldout_seq = np.random.SeedSequence(seed).spawn(2)
  train_records = _draw_unique(np.random.default_rng(train_seq), train, frozenset(), templates)
  seen = frozenset(r["question"] for r in train_records)
  heldout_records = _draw_unique(np.random.default_rng(heldout_seq), heldout, seen, templates)
  assert seen.isdisjoint(r["question"] for r in heldout_records)
  return train_records, heldout_records


def heldout_phrasings(*, seed: int, n: int, family: str = "one_step") -> list[dict]:
  """Returns ``n`` records of ``family``'s held-out phrasings: templates that neither `splits`
  set draws from, so none of their sentences is trained on.

  They come from a third stream of ``seed`` (``SeedSequence(seed).spawn(3)[2]``; `splits` uses
  the first two), so they depend on neither split's size.
  """
  _check_count("n", n)
  _templates(family)
  if family not in HELDOUT_PHRASINGS:
    raise ValueError(
      f"the {family!r} word problems have no held-out phrasings; families that do: "
      f"{', '.join(HELDOUT_PHRASINGS)}."
    )
  seq = np.random.SeedSequence(seed).spawn(3)[2]
  return _draw_unique(np.random.default_rng(seq), n, frozenset(), HELDOUT_PHRASINGS[family])


def splits_of(family: str) -> tuple[str, ...]:
  """The splits ``family`` has: ``train`` and ``heldout``, and ``heldout_phrasings`` if it has
  held-out phrasings."""
  _templates(family)
  return SPLITS if family in HELDOUT_PHRASINGS else SPLITS[:2]


def fixed_split(name: str, family: str = "mixed") -> list[dict]:
  """Returns split ``name`` (one of `SPLITS`) of the generated task data of ``family``.

  ``"train"`` and ``"heldout"`` come from ``splits(seed=DATA_SEED, train=TRAIN_SIZE,
  heldout=HELDOUT_SIZE)``, so training on ``"train"`` never sees a ``"heldout"`` question;
  ``"heldout_phrasings"`` from ``heldout_phrasings(seed=DATA_SEED, n=HELDOUT_SIZE)``, whose
  templates ``"train"`` never uses.
  """
  if name not in splits_of(family):
    raise ValueError(
      f"unknown generated split {name!r} of the {family!r} word problems; choose one of: "
      f"{', '.join(splits_of(family))}."
    )
  if name == "heldout_phrasings":
    return heldout_phrasings(seed=DATA_SEED, n=HELDOUT_SIZE, family=family)
  train, heldout = splits(seed=DATA_SEED, train=TRAIN_SIZE, heldout=HELDOUT_SIZE, family=family)
  return train if name == "train" else heldout


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> None:
  """Writes ``records`` to ``path`` as UTF-8 JSONL, one object a line (what GSM8K loaders read)."""
  with open(path, "w", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record) + "\n")
