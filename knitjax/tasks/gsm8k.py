"""GSM8K-style word problems with a numeric-answer verifier.

Each example is ``{"question": str, "answer": str}`` where the answer ends in ``#### <number>``
(the GSM8K format; the worked solution before it is ignored). `load_examples` reads them from:

- a JSONL file, one object a line: GSM8K's own files and the Hugging Face ``datasets`` export
  (``Dataset.to_json``); fields other than ``question`` and ``answer`` are ignored;
- a parquet file (a name ending in ``.parquet``, or a file starting with parquet's ``PAR1``
  magic): ``Dataset.to_parquet`` or the hub's ``main/train-00000-of-00001.parquet``; read with
  pyarrow, imported only then; errors name the file and ``row <i>``, ``i`` counting from 0 as
  ``datasets`` indexes rows;
- ``"generated:train"`` or ``"generated:heldout"``: the generated word problems of
  `knitjax.tasks.word_problems` (fixed data seed ``word_problems.DATA_SEED``, 4096 training and
  512 held-out problems that share no question), built in memory; evaluate on
  ``"generated:heldout"`` a policy trained on ``"generated:train"``.

Prompts: with the character tokenizer (``tokenizer=None`` in `make_source`) or ``chat=False`` the
prompt is the plain text `TEMPLATE` (``"Question: ...\nAnswer:"``) encoded with BOS, for base
models. With a tokenizer that has a chat template (a Hugging Face instruct model) the prompt is
the chat messages (an optional system prompt, then the question and `INSTRUCTION` as the user
turn) rendered by ``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` and encoded
without added special tokens, since the rendered text holds its own. ``Prompt.text`` is the text
that was encoded.

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
exact `fractions.Fraction` s, so ``3/4 == 0.75`` and ``1e5 == 100,000``. A completion's answer
(`answer_number`) is the first number after its first ``####`` when there is one, else its last
number (the GSM8K convention).

Tokenizers are duck-typed: `CharTokenizer` or any object with its methods (``encode(text, *,
bos)``, ``num_tokens(text, *, bos)``, ``decode(ids, *, stop_at_eos)``, ``eos_id``) plus, for chat
prompts, ``chat_template`` and ``apply_chat_template``; ``eos_ids`` (every stop id) is used when
present.
"""

import json
import os
import re
from collections.abc import Iterator
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

import numpy as np

from knitjax.tasks import word_problems
from knitjax.tasks.prompts import Prompt, PromptSource
from knitjax.tasks.tokenizer import CharTokenizer

ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
TEMPLATE = "Question: {question}\nAnswer:"
# Follows the question in the user turn of a chat prompt.
INSTRUCTION = "Solve the problem step by step and give the final answer after '####'."
# Path prefix of the generated word problems: "generated:train", "generated:heldout".
GENERATED = "generated:"
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


def _jsonl_records(path: str) -> Iterator[tuple[str, Any]]:
  """Yields (``file:line``, parsed JSON value) for each non-blank line of a JSONL file."""
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
      yield where, record


def _parquet_records(path: str) -> Iterator[tuple[str, Any]]:
  """Yields (``file:row <i>``, ``{"question": ..., "answer": ...}``) for each parquet row."""
  try:
    import pyarrow as pa
    import pyarrow.parquet as pq
  except ImportError:
    raise ValueError(
      f"GSM8K file {path!r} is parquet, which needs pyarrow; pip install pyarrow."
    ) from None
  fields = ["question", "answer"]
  row = 0
  try:
    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    missing = [name for name in fields if name not in names]
    if missing:
      raise ValueError(
        f"{path}: parquet file has no column {missing[0]!r} (its columns: {', '.join(names)}); "
        "GSM8K needs 'question' and 'answer'."
      )
    for batch in parquet.iter_batches(columns=fields):
      for record in batch.to_pylist():
        yield f"{path}:row {row}", record
        row += 1
  except (OSError, pa.ArrowException) as e:
    raise ValueError(f"GSM8K file {path!r} is not a readable parquet file ({e}).") from None


def _is_parquet(path: str) -> bool:
  if path.lower().endswith(".parquet"):
    return True
  try:
    with open(path, "rb") as f:
      return f.read(4) == b"PAR1"
  except OSError:
    return False  # the JSONL reader names the error


def _records(path: str) -> Iterator[tuple[str, Any]]:
  """Yields (where, record) from a JSONL or parquet file or a ``generated:<split>`` path."""
  if path.startswith(GENERATED):
    split = path[len(GENERATED) :]
    if split not in word_problems.SPLITS:
      raise ValueError(
        f"unknown generated data {path!r}; choose one of: "
        f"{', '.join(GENERATED + s for s in word_problems.SPLITS)}."
      )
    for row, record in enumerate(word_problems.fixed_split(split)):
      yield f"{path}:row {row}", record
    return
  if not os.path.isfile(path):
    raise ValueError(f"GSM8K file {path!r} does not exist (or is not a regular file).")
  yield from (_parquet_records if _is_parquet(path) else _jsonl_records)(path)


def _use_chat(tokenizer, chat: bool | None, system_prompt: str | None) -> bool:
  """Resolves ``chat`` (None: whether the tokenizer has a chat template) and checks the pair."""
  has_template = bool(getattr(tokenizer, "chat_template", None))
  if chat is None:
    chat = has_template
  elif chat and not has_template:
    raise ValueError(
      f"chat=True needs a tokenizer with a chat template, but {tokenizer!r} has none; pass "
      "chat=False for plain 'Question: ... Answer:' prompts (base models)."
    )
  if system_prompt is not None and not chat:
    raise ValueError(
      f"system_prompt={system_prompt[:40]!r} needs chat prompts, but chat is off (a base model or "
      "the character tokenizer); drop the system prompt or use a tokenizer with a chat template."
    )
  return bool(chat)


def _render(question: str, tokenizer, *, chat, template, system_prompt, instruction) -> str:
  """Returns the prompt text of ``question``: chat messages rendered, or ``template`` filled."""
  if not chat:
    return template.format(question=question)
  messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
  content = f"{question}\n\n{instruction}" if instruction else question
  messages.append({"role": "user", "content": content})
  return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _check_length(where: str, num_tokens: int, max_prompt_tokens: int) -> None:
  if num_tokens > max_prompt_tokens:
    raise ValueError(
      f"{where}: the prompt is {num_tokens} tokens long, over the limit of "
      f"{max_prompt_tokens} (max_prompt_tokens); shorten the question or raise the limit."
    )


def load_examples(
  path: str,
  tokenizer,
  *,
  cls: str = "gsm8k",
  template: str = TEMPLATE,
  max_prompt_tokens: int = MAX_PROMPT_TOKENS,
  chat: bool | None = None,
  system_prompt: str | None = None,
  instruction: str = INSTRUCTION,
) -> list[Prompt]:
  """Reads GSM8K-style examples into prompts; blank JSONL lines are skipped.

  Args:
    path: a JSONL file (UTF-8, one ``{"question": str, "answer": str, ...}`` object a line), a
      parquet file with ``question`` and ``answer`` columns, or ``"generated:train"`` /
      ``"generated:heldout"`` (see the module docstring).
    tokenizer: the task's tokenizer (`CharTokenizer` or one with the same methods).
    cls: quota class of the prompts.
    template: plain prompts: the text, with ``{question}`` where the question goes.
    max_prompt_tokens: longest prompt accepted, in tokens with BOS and the template.
    chat: render the prompt with the tokenizer's chat template; None: when it has one.
    system_prompt: chat prompts: the system message, or None for none.
    instruction: chat prompts: text after the question in the user message ("" for none).

  Returns:
    The prompts in file order; ``answer`` is the number after ``####`` without ``$`` or
    thousands commas (``"#### $1,234"`` -> ``"1234"``).

  Raises:
    ValueError: naming the file (and line or row) when the file is missing, unreadable or empty,
      a line is not UTF-8 or not a JSON object, a field is missing or not a string, the answer
      has no ``#### <number>``, the prompt is longer than ``max_prompt_tokens``, or the text has
      a character outside the tokenizer's alphabet; also for ``chat=True`` without a chat
      template, or a ``system_prompt`` without chat prompts.
  """
  if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int):
    raise ValueError(f"max_prompt_tokens must be an integer >= 1, got {max_prompt_tokens!r}.")
  if max_prompt_tokens < 1:
    raise ValueError(f"max_prompt_tokens must be an integer >= 1, got {max_prompt_tokens}.")
  chat = _use_chat(tokenizer, chat, system_prompt)
  bos = not chat  # a rendered chat template holds its own BOS text, if the model has one
  examples = []
  for where, record in _records(path):
    if not isinstance(record, dict):
      raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}.")
    for field in ("question", "answer"):
      if not isinstance(record.get(field), str):
        raise ValueError(f"{where}: field {field!r} is missing or not a string.")
    _, sep, final = record["answer"].rpartition("####")
    match = _last_match(final) if sep else None
    if match is None or _value(match) is None:
      raise ValueError(f"{where}: answer must end in '#### <number>', got {final.strip()[:80]!r}.")
    text = _render(
      record["question"],
      tokenizer,
      chat=chat,
      template=template,
      system_prompt=system_prompt,
      instruction=instruction,
    )
    # A text longer than the limit in characters may be a huge question: count its tokens
    # before encoding (free for the character tokenizer) so it never becomes a token list.
    # Shorter texts are encoded once and measured (a BPE tokenizer counts by encoding).
    if len(text) > max_prompt_tokens:
      _check_length(where, tokenizer.num_tokens(text, bos=bos), max_prompt_tokens)
    try:
      tokens = tokenizer.encode(text, bos=bos)
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
    _check_length(where, len(tokens), max_prompt_tokens)
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
    raise ValueError(f"GSM8K file {path!r} holds no examples (every line is blank, or no rows).")
  return examples


def make_source(
  *,
  seed: int,
  path: str,
  cls: str = "gsm8k",
  shuffle: bool = True,
  max_prompt_tokens: int = MAX_PROMPT_TOKENS,
  tokenizer=None,
  chat: bool | None = None,
  system_prompt: str | None = None,
  instruction: str = INSTRUCTION,
) -> tuple[PromptSource, Any]:
  """Returns (an endless PromptSource over the examples at ``path``, the tokenizer).

  ``tokenizer=None`` uses the character tokenizer (`make_tokenizer`) with plain prompts. Training
  on ``path="generated:train"`` and evaluating on ``"generated:heldout"`` keeps the evaluation
  questions unseen. The other arguments are `load_examples`'.
  """
  if tokenizer is None:
    tokenizer = make_tokenizer()
  examples = load_examples(
    path,
    tokenizer,
    cls=cls,
    max_prompt_tokens=max_prompt_tokens,
    chat=chat,
    system_prompt=system_prompt,
    instruction=instruction,
  )
  return PromptSource(examples, seed=seed, shuffle=shuffle), tokenizer


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
