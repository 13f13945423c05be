"""The numeric-answer verifier of math word problems: exact numbers read from text, and rewards.

`last_number`, `answer_number` and `last_number_text` read numbers; `numeric_match_reward`,
`format_reward` and `math_reward` (the ``numeric_match`` and ``math`` rewards of
`knitjax.tasks.rewards`) score a completion against a prompt's answer. `knitjax.tasks.gsm8k` reads
the answers of its files with the same rules.

Numbers (read the same way in a file's answers and in completions): optional sign (``-3``,
unless the minus joins two terms as in ``10-5``), optional dollar sign (``$1,000``), digits with
thousands commas only in groups of three (``1,000,000``; ``1,2`` is the two numbers 1 and 2),
decimals (``-3.5``, ``.5``), scientific notation (``1e5``, ``2.5E-3``) and fractions of integers
(``3/4``). A full stop after the digits ends a sentence, not a number (``42.`` is 42). Values are
exact `fractions.Fraction` s, so ``3/4 == 0.75`` and ``1e5 == 100,000``. A completion's answer
(`answer_number`) is the first number after its first ``####`` when there is one, else its last
number (the GSM8K convention).

Tokenizers are duck-typed: a reward needs ``decode(ids, *, stop_at_eos)`` and ``eos_id``;
``eos_ids`` (every stop id) is used when present.
"""

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

import numpy as np

from knitjax.tasks.prompts import Prompt

# Numbers beyond 10**+-1000 are not answers; the bound keeps exact arithmetic on them cheap.
_MAX_EXPONENT = 1000

_INT = r"\d{1,3}(?:,\d{3})+(?!\d)|\d+"  # thousands commas only in whole groups of three
_NUMBER_RE = re.compile(
  rf"""
  (?P<sign>(?<![\w)])[-+])?  # a sign, but not the operator between two terms ("10-5")
  \$?
  (?:
    (?P<num>{_INT})/(?P<den>\d+)(?!\d|\.\d)  # a fraction of integers: 3/4
  | (?P<dec>(?:{_INT})(?:\.\d+)?|\.\d+)(?P<exp>[eE][-+]?\d+)?  # 42, 1,000.5, .5, 2.5E-3
  )
  """,
  re.VERBOSE,
)


def _decimal(text: str) -> Decimal | None:
  """Returns ``text`` (digits, commas, point, exponent) as a Decimal, or None when out of range."""
  try:
    value = Decimal(text.replace(",", ""))
  except InvalidOperation:  # an exponent too large for Decimal itself
    return None
  if value and abs(value.adjusted()) > _MAX_EXPONENT:
    return None
  return value


def _value(match: re.Match) -> Fraction | None:
  """Returns the exact value of one `_NUMBER_RE` match, or None (x/0, out of range)."""
  if match["num"] is not None:
    num, den = _decimal(match["num"]), _decimal(match["den"])
    if num is None or den is None or den == 0:
      return None
    value = Fraction(num) / Fraction(den)
  else:
    dec = _decimal(match["dec"] + (match["exp"] or ""))
    if dec is None:
      return None
    value = Fraction(dec)
  return -value if match["sign"] == "-" else value


def _last_match(text: str) -> re.Match | None:
  last = None
  for last in _NUMBER_RE.finditer(text):  # noqa: B007 - only the last match is wanted
    pass
  return last


def last_number(text: str) -> Fraction | None:
  """Returns the exact value of the last number in ``text``, or None when there is none.

  See the module docstring for what counts as a number. None also when the last number cannot
  be a value: a fraction over zero, or a magnitude beyond ``10**1000`` (or nonzero below
  ``10**-1000``).
  """
  match = _last_match(text)
  return None if match is None else _value(match)


def answer_number(text: str) -> Fraction | None:
  """Returns a completion's answer: the first number after its first ``####``, else its last number.

  ``####`` is GSM8K's answer marker, so text after the answer (a model that goes on to write
  another question) does not change it; without the marker, the last number is the answer.
  None when there is no number (or the one chosen has no value, as `last_number`).
  """
  marker = text.find("####")
  if marker >= 0:
    match = _NUMBER_RE.search(text, marker + 4)
    if match is not None:
      return _value(match)
  return last_number(text)


def last_number_text(text: str) -> str | None:
  """Returns the last number in ``text`` as written (sign, ``$`` and commas kept), or None.

  None when there is no number, or when the last one has no value (as `last_number`).
  """
  match = _last_match(text)
  return None if match is None or _value(match) is None else match.group(0)


def _eos_ids(tokenizer) -> tuple[int, ...]:
  return tuple(getattr(tokenizer, "eos_ids", None) or (tokenizer.eos_id,))


def numeric_match_reward(prompt: Prompt, completion_ids: np.ndarray, tokenizer) -> float:
  """1.0 when the completion's answer (up to the first EOS) equals the prompt's answer.

  The completion's answer is `answer_number`'s: the number after ``####``, else the last
  number. The values compare exactly (`last_number`): ``0.75`` matches ``3/4`` and ``1e5``
  matches ``100000``. EOS is not required: a completion cut at the generation budget is still
  checked. The text is ``tokenizer.decode(ids, stop_at_eos=True)``, which stops at any of the
  tokenizer's EOS ids. Any id the model can sample is accepted; ids beyond the character
  tokenizer's vocabulary decode to a character that is never part of a number.
  """
  got = answer_number(tokenizer.decode(completion_ids, stop_at_eos=True))
  want = last_number(prompt.answer)
  return float(got is not None and want is not None and got == want)


def format_reward(prompt: Prompt, completion_ids: np.ndarray, tokenizer) -> float:
  """1.0 when the completion ends (an EOS id was produced) and has exactly one answer line.

  The answer line is the one ``####`` of the text before the first EOS, followed on its line by
  one number alone (``#### 42``, ``#### $1,234.``); the number need not be right. ``prompt`` is
  unused: the format is the same for every question.
  """
  del prompt
  ids = np.asarray(completion_ids).reshape(-1)
  if not np.isin(ids, _eos_ids(tokenizer)).any():
    return 0.0
  text = tokenizer.decode(ids, stop_at_eos=True)
  if text.count("####") != 1:
    return 0.0
  rest = text.split("####", 1)[1].split("\n", 1)[0].strip().removesuffix(".")
  match = _NUMBER_RE.fullmatch(rest)
  return float(match is not None and _value(match) is not None)


def math_reward(
  prompt: Prompt, completion_ids: np.ndarray, tokenizer, *, format_weight: float = 0.1
) -> float:
  """`numeric_match_reward` plus ``format_weight`` times `format_reward`: in ``[0, 1 + w]``.

  A right answer scores 1.0 whatever its format, so the format term only breaks ties (and
  teaches a model to stop after its ``####`` line).
  """
  correct = numeric_match_reward(prompt, completion_ids, tokenizer)
  return correct + format_weight * format_reward(prompt, completion_ids, tokenizer)
