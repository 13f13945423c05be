"""GSM8K-style word problems from JSONL, with a numeric-answer verifier.

Each line is ``{"question": str, "answer": str}`` where the answer ends in ``#### <number>`` (the
GSM8K format; the worked solution before it is ignored). Text is tokenized per character over
printable ASCII plus newline.

Prompt length: a file-backed task has no natural bound on its prompts, and the runtime pads every
prompt to the longest one (``config.task.prompt_len=0``), so one huge question would size every
prompt buffer and KV cache. `load_examples` therefore rejects, with a ``ValueError`` naming the
file, line and lengths, any example whose prompt (BOS and template included) is longer than
``max_prompt_tokens`` (default `MAX_PROMPT_TOKENS`); it never cuts a question, since a cut
question may no longer have its answer.

Numbers (`last_number`, used for the file's answers and for completions): optional sign (``-3``,
unless the minus joins two terms as in ``10-5``), optional dollar sign (``$1,000``), digits with
thousands commas only in groups of three (``1,000,000``; ``1,2`` is the two numbers 1 and 2),
decimals (``-3.5``, ``.5``), scientific notation (``1e5``, ``2.5E-3``) and fractions of integers
(``3/4``). A full stop after the digits ends a sentence, not a number (``42.`` is 42). Values are
exact `fractions.Fraction` s, so ``3/4 == 0.75`` and ``1e5 == 100,000``.
"""

import json
import os
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

import numpy as np

from knitjax.tasks.prompts import Prompt, PromptSource
from knitjax.tasks.tokenizer import CharTokenizer

ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
TEMPLATE = "Question: {question}\nAnswer:"
# Default bound on a prompt's tokens (BOS and template included) for file-backed examples.
MAX_PROMPT_TOKENS = 4096
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


def make_tokenizer() -> CharTokenizer:
  """Returns the printable-ASCII tokenizer (vocab_size 99)."""
  return CharTokenizer(ALPHABET)


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


def load_examples(
  path: str,
  tokenizer: CharTokenizer,
  *,
  cls: str = "gsm8k",
  template: str = TEMPLATE,
  max_prompt_tokens: int = MAX_PROMPT_TOKENS,
) -> list[Prompt]:
  """Reads a GSM8K-style JSONL file into prompts; blank lines are skipped.

  Args:
    path: the JSONL file, UTF-8, one ``{"question": str, "answer": str}`` object a line.
    tokenizer: the task's tokenizer.
    cls: quota class of the prompts.
    template: the prompt text, with ``{question}`` where the question goes.
    max_prompt_tokens: longest prompt accepted, in tokens with BOS and the template.

  Returns:
    The prompts in file order; ``answer`` is the number after ``####`` without ``$`` or
    thousands commas (``"#### $1,234"`` -> ``"1234"``).

  Raises:
    ValueError: naming the file (and line) when the file is missing, unreadable or empty, a line
      is not UTF-8 or not a JSON object, a field is missing or not a string, the answer has no
      ``#### <number>``, the prompt is longer than ``max_prompt_tokens``, or the text has a
      character outside the tokenizer's alphabet.
  """
  if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int):
    raise ValueError(f"max_prompt_tokens must be an integer >= 1, got {max_prompt_tokens!r}.")
  if max_prompt_tokens < 1:
    raise ValueError(f"max_prompt_tokens must be an integer >= 1, got {max_prompt_tokens}.")
  if not os.path.isfile(path):
    raise ValueError(f"GSM8K file {path!r} does not exist (or is not a regular file).")
  examples = []
  try:
    f = open(path, "rb")  # noqa: SIM115 - closed below; bytes, so a bad line can be named
  except OSError as e:
    raise ValueError(f"GSM8K file {path!r} cannot be read ({e.strerror}).") from None
  with f:
    for lineno, raw in enumerate(f, start=1):
      where = f"{path}:{lineno}"
      try:
        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (byte {e.start} of the line).") from None
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg}).") from None
      except (ValueError, RecursionError) as e:  # e.g. an integer of more than 4300 digits
        raise ValueError(f"{where}: invalid JSON ({type(e).__name__}).") from None
      if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}.")
      for field in ("question", "answer"):
        if not isinstance(record.get(field), str):
          raise ValueError(f"{where}: field {field!r} is missing or not a string.")
      _, sep, final = record["answer"].rpartition("####")
      match = _last_match(final) if sep else None
      if match is None or _value(match) is None:
        raise ValueError(
          f"{where}: answer must end in '#### <number>', got {final.strip()[:80]!r}."
        )
      text = template.format(question=record["question"])
      # Counted before encoding so a huge question costs no token list.
      num_tokens = tokenizer.num_tokens(text)
      if num_tokens > max_prompt_tokens:
        raise ValueError(
          f"{where}: the prompt is {num_tokens} tokens long, over the limit of "
          f"{max_prompt_tokens} (max_prompt_tokens); shorten the question or raise the limit."
        )
      try:
        tokens = tokenizer.encode(text)
      except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
      examples.append(
        Prompt(
          prompt_id=len(examples),
          cls=cls,
          text=text,
          tokens=np.asarray(tokens, np.int32),
          answer=match.group(0).replace("$", "").replace(",", ""),
        )
      )
  if not examples:
    raise ValueError(f"GSM8K file {path!r} holds no examples (every line is blank).")
  return examples


def make_source(
  *,
  seed: int,
  path: str,
  cls: str = "gsm8k",
  shuffle: bool = True,
  max_prompt_tokens: int = MAX_PROMPT_TOKENS,
) -> tuple[PromptSource, CharTokenizer]:
  """Returns (an endless PromptSource over the file's examples, the tokenizer).

  ``max_prompt_tokens`` bounds each prompt's length; see `load_examples`.
  """
  tokenizer = make_tokenizer()
  examples = load_examples(path, tokenizer, cls=cls, max_prompt_tokens=max_prompt_tokens)
  return PromptSource(examples, seed=seed, shuffle=shuffle), tokenizer


def numeric_match_reward(
  prompt: Prompt, completion_ids: np.ndarray, tokenizer: CharTokenizer
) -> float:
  """1.0 when the last number of the completion (up to EOS) equals the answer's number.

  The values compare exactly (`last_number`): ``0.75`` matches ``3/4`` and ``1e5`` matches
  ``100000``. EOS is not required: a completion cut at the generation budget is still checked.
  Any id the model can sample is accepted; ids beyond the tokenizer's vocabulary decode to a
  character that is never part of a number (`CharTokenizer.decode`).
  """
  got = last_number(tokenizer.decode(completion_ids, stop_at_eos=True))
  want = last_number(prompt.answer)
  return float(got is not None and want is not None and got == want)
