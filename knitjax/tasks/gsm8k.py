"""GSM8K-style word problems read into prompts: JSONL or parquet files, or the generated ones.

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
  ``"generated:heldout"`` a policy trained on ``"generated:train"``. ``"generated:one_step:train"``
  / ``"generated:one_step:heldout"`` are the one-step family (one operation each), and
  ``"generated:mixed:<split>"`` is the default family spelled out.
  ``"generated:one_step:heldout_phrasings"`` (512 problems) is written in templates that the
  one-step ``train`` and ``heldout`` splits never use: whether what was learned transfers to
  other wording.

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
question may no longer have its answer. A question of more than ``max_prompt_tokens *
MAX_CHARS_PER_TOKEN`` characters is refused before it is rendered or tokenized.

Numbers: answers are read as `knitjax.tasks.math_verifier` reads them (its module docstring says
what counts as a number), and its rewards score completions.

Tokenizers are duck-typed: `CharTokenizer` or any object with its methods (``encode(text, *,
bos)``, ``num_tokens(text, *, bos)``, ``decode(ids, *, stop_at_eos)``, ``eos_id``) plus, for chat
prompts, ``chat_template`` and ``apply_chat_template``; ``eos_ids`` (every stop id) is used when
present.
"""

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from knitjax.tasks import word_problems
from knitjax.tasks.math_verifier import last_number_text
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
# More characters than any one token of a real vocabulary covers (the longest tokens of GPT-4's
# and Llama 3's byte-level BPE are 128 characters of a repeated symbol): a question over
# max_prompt_tokens * MAX_CHARS_PER_TOKEN characters cannot fit, and is refused before it is
# rendered or tokenized (a BPE tokenizer took 93 s on a 50 MB line before the count refused it).
MAX_CHARS_PER_TOKEN = 256


def make_tokenizer() -> CharTokenizer:
  """Returns the printable-ASCII tokenizer (vocab_size 99)."""
  return CharTokenizer(ALPHABET)


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
    family, split = generated_path(path)
    for row, record in enumerate(word_problems.fixed_split(split, family)):
      yield f"{path}:row {row}", record
    return
  if not os.path.isfile(path):
    raise ValueError(f"GSM8K file {path!r} does not exist (or is not a regular file).")
  yield from (_parquet_records if _is_parquet(path) else _jsonl_records)(path)


def generated_path(path: str) -> tuple[str, str]:
  """(family, split) of a ``"generated:[<family>:]<split>"`` path; a ``ValueError`` naming the
  choices otherwise."""
  parts = path[len(GENERATED) :].split(":")
  family, split = ("mixed", parts[0]) if len(parts) == 1 else (parts[0], parts[-1])
  known = family in word_problems.FAMILIES and split in word_problems.splits_of(family)
  if len(parts) > 2 or not known:
    choices = [
      f"{GENERATED}{f}:{s}" for f in word_problems.FAMILIES for s in word_problems.splits_of(f)
    ]
    raise ValueError(f"unknown generated data {path!r}; choose one of: {', '.join(choices)}.")
  return family, split


def set_name(path: str) -> str:
  """The name of the held-out set at ``path`` in eval metric keys and file names: a generated
  path's split (``heldout_phrasings``), else the file's name without its extension, lowercased,
  each character other than a-z, 0-9 and _ made ``_``."""
  if path.startswith(GENERATED):
    return generated_path(path)[1]
  stem = os.path.splitext(os.path.basename(path.rstrip("/")))[0]
  return re.sub(r"[^a-z0-9_]", "_", stem.lower()) or "file"


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


def _check_text(where: str, field: str, text: str) -> None:
  """Refuses text that is not valid Unicode (JSON's "\\ud800" escape: a lone surrogate)."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ValueError(
      f"{where}: field {field!r} holds a lone surrogate (U+{ord(text[e.start]):04X} at character "
      f"{e.start}); accepted: valid Unicode text."
    ) from None


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
      a line is not UTF-8 or not a JSON object, a field is missing or not a string or holds a
      lone surrogate, the question is empty, the answer has no ``#### <number>``, the question
      has more than ``max_prompt_tokens * MAX_CHARS_PER_TOKEN`` characters or the prompt more
      than ``max_prompt_tokens`` tokens, or the text has a character outside the tokenizer's
      alphabet; also for ``chat=True`` without a chat
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
      _check_text(where, field, record[field])
    if not record["question"].strip():
      raise ValueError(f"{where}: field 'question' is empty; accepted: a question to answer.")
    if len(record["question"]) > max_prompt_tokens * MAX_CHARS_PER_TOKEN:
      raise ValueError(
        f"{where}: the question is {len(record['question']):,} characters long, more than a "
        f"prompt of {max_prompt_tokens} tokens (max_prompt_tokens) can hold at "
        f"{MAX_CHARS_PER_TOKEN} characters a token; shorten the question or raise the limit."
      )
    _, sep, final = record["answer"].rpartition("####")
    written = last_number_text(final) if sep else None
    if written is None:
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
        answer=written.replace("$", "").replace(",", ""),
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
