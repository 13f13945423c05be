"""GSM8K-style word problems from JSONL, with a numeric-answer verifier.

Each line is ``{"question": str, "answer": str}`` where the answer ends in ``#### <number>`` (the
GSM8K format; the worked solution before it is ignored). Text is tokenized per character over
printable ASCII plus newline.
"""

import decimal
import json
import os
import re

import numpy as np

from knitjax.tasks.prompts import Prompt, PromptSource
from knitjax.tasks.tokenizer import CharTokenizer

ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
TEMPLATE = "Question: {question}\nAnswer:"

# A number: optional sign, digits with optional thousands commas ("1,234"), optional decimals.
# A trailing full stop is not a decimal point ("is 18." -> 18).
_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|[-+]?\.\d+")


def make_tokenizer() -> CharTokenizer:
  """Returns the printable-ASCII tokenizer (vocab_size 99)."""
  return CharTokenizer(ALPHABET)


def last_number(text: str) -> decimal.Decimal | None:
  """Returns the last number in ``text`` (commas, signs and decimals handled), or None."""
  matches = _NUMBER_RE.findall(text)
  if not matches:
    return None
  try:
    return decimal.Decimal(matches[-1].replace(",", ""))
  except decimal.InvalidOperation:
    return None


def load_examples(
  path: str,
  tokenizer: CharTokenizer,
  *,
  cls: str = "gsm8k",
  template: str = TEMPLATE,
) -> list[Prompt]:
  """Reads a GSM8K-style JSONL file into prompts; blank lines are skipped.

  Raises:
    ValueError: naming the file (and line) when the file is missing or empty, a line is not a
      JSON object, a field is missing or not a string, the answer has no ``#### <number>``, or
      the text has a character outside the tokenizer's alphabet.
  """
  if not os.path.isfile(path):
    raise ValueError(f"GSM8K file {path!r} does not exist.")
  examples = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      where = f"{path}:{lineno}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg}).") from None
      if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}.")
      for field in ("question", "answer"):
        if not isinstance(record.get(field), str):
          raise ValueError(f"{where}: field {field!r} is missing or not a string.")
      _, sep, final = record["answer"].rpartition("####")
      number = last_number(final) if sep else None
      if number is None:
        raise ValueError(f"{where}: answer must end in '#### <number>', got {final.strip()!r}.")
      text = template.format(question=record["question"])
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
          answer=final.strip().replace(",", ""),
        )
      )
  if not examples:
    raise ValueError(f"GSM8K file {path!r} holds no examples.")
  return examples


def make_source(
  *, seed: int, path: str, cls: str = "gsm8k", shuffle: bool = True
) -> tuple[PromptSource, CharTokenizer]:
  """Returns (an endless PromptSource over the file's examples, the tokenizer)."""
  tokenizer = make_tokenizer()
  examples = load_examples(path, tokenizer, cls=cls)
  return PromptSource(examples, seed=seed, shuffle=shuffle), tokenizer


def numeric_match_reward(
  prompt: Prompt, completion_ids: np.ndarray, tokenizer: CharTokenizer
) -> float:
  """1.0 when the last number of the completion (up to EOS) equals the answer's number.

  EOS is not required: a completion cut at the generation budget is still checked.
  """
  got = last_number(tokenizer.decode(completion_ids, stop_at_eos=True))
  want = last_number(prompt.answer)
  return float(got is not None and want is not None and got == want)
