"""Bad prompt files, fed to `knitjax.tasks.gsm8k.load_examples`: GSM8K JSONL with one bad line."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

from hypothesis import strategies as st

from lab.faults.bad_inputs.core import BadInput, Case, Draw, baseline
from lab.faults.bad_inputs.strategies import (
  IDENT,
  LIST,
  TEXT,
)

_MAX_PROMPT_TOKENS = 64  # small, so an over-long question stays cheap; good questions are <= 20
_PRINTABLE = "".join(chr(c) for c in range(32, 127))
_RECORD = st.fixed_dictionaries(
  {
    "question": st.text(alphabet=_PRINTABLE, min_size=1, max_size=20).filter(str.strip),
    "answer": st.builds(
      lambda work, n: f"{work} #### {n}",
      st.text(alphabet=_PRINTABLE, max_size=20),
      st.integers(-(10**6), 10**6),
    ),
  }
)


def context(folder: str) -> dict:
  from knitjax.tasks import gsm8k

  ctx = {"folder": folder, "tokenizer": gsm8k.make_tokenizer()}
  path = os.path.join(folder, "pristine.jsonl")
  with open(path, "w") as f:
    f.write(json.dumps({"question": "What is 2+3?", "answer": "2+3=5 #### 5"}) + "\n")
  baseline("GSM8K file", lambda: _load_prompts(ctx, path))
  return ctx


def _load_prompts(ctx: dict, path: str):
  from knitjax.tasks import gsm8k

  return gsm8k.load_examples(path, ctx["tokenizer"], max_prompt_tokens=_MAX_PROMPT_TOKENS)


def _jsonl_with(draw: Draw, ctx: dict, case: str, bad_line: bytes) -> BadInput:
  """A file of good lines with ``bad_line`` at a drawn position; the rejection names that line."""
  lines = [json.dumps(r).encode() for r in draw(st.lists(_RECORD, max_size=4))]
  at = draw(st.integers(0, len(lines)))
  lines.insert(at, bad_line)
  path = os.path.join(ctx["folder"], f"{case}.jsonl")
  with open(path, "wb") as f:
    f.write(b"\n".join(lines) + b"\n")
  where = f"{path}:{at + 1}"
  return BadInput(
    f"{where}: {bad_line[:160]!r}", (where,), lambda: _load_prompts(ctx, path), file_errors=True
  )


def _line_case(make_line: Callable[[Draw], bytes]) -> Callable[[Draw, dict], BadInput]:
  def make(draw: Draw, ctx: dict) -> BadInput:
    return _jsonl_with(draw, ctx, make_line.__name__.lstrip("_"), make_line(draw))

  return make


def _invalid_json(draw: Draw) -> bytes:
  good = json.dumps(draw(_RECORD))
  if draw(st.booleans()):  # an unclosed object
    return good[: draw(st.integers(1, len(good) - 1))].encode()
  return (good + draw(st.sampled_from(["}", "]", ",", " x", "{}", '"']))).encode()


def _not_utf8(draw: Draw) -> bytes:
  good = json.dumps(draw(_RECORD)).encode()
  at = draw(st.integers(0, len(good)))
  return good[:at] + draw(st.sampled_from([b"\xff", b"\xfe", b"\xc0", b"\x80"])) + good[at:]


def _not_object(draw: Draw) -> bytes:
  value = draw(st.one_of(LIST, st.integers(), TEXT, st.none(), st.booleans(), st.floats()))
  return json.dumps(value).encode()


def _missing_field(draw: Draw) -> bytes:
  record = draw(_RECORD)
  del record[draw(st.sampled_from(["question", "answer"]))]
  return json.dumps(record).encode()


def _non_string_field(draw: Draw) -> bytes:
  record = draw(_RECORD)
  value = st.one_of(st.integers(), st.floats(allow_nan=False), LIST, st.none(), st.booleans())
  record[draw(st.sampled_from(["question", "answer"]))] = draw(value)
  return json.dumps(record).encode()


def _no_final_number(draw: Draw) -> bytes:
  record = draw(_RECORD)
  no_digits = st.text(alphabet="".join(c for c in _PRINTABLE if not c.isdigit()), max_size=20)
  record["answer"] = draw(
    st.one_of(
      TEXT.filter(lambda t: "####" not in t),  # no "####" at all
      no_digits.map(lambda t: f"{draw(st.text(max_size=10))} #### {t}"),
      st.sampled_from(["#### 1/0", "#### 3/0", "#### 1e2000", "#### -2e-5000"]),
    )
  )
  return json.dumps(record).encode()


def _too_long(draw: Draw) -> bytes:
  record = draw(_RECORD)
  n = draw(st.integers(_MAX_PROMPT_TOKENS + 1, _MAX_PROMPT_TOKENS + 300))
  record["question"] = draw(st.text(alphabet=_PRINTABLE, min_size=n, max_size=n))
  return json.dumps(record).encode()


def _bad_char(draw: Draw) -> bytes:
  from knitjax.tasks import gsm8k

  record = draw(_RECORD)
  c = draw(st.characters(exclude_characters=gsm8k.ALPHABET))
  at = draw(st.integers(0, len(record["question"])))
  record["question"] = record["question"][:at] + c + record["question"][at:]
  return json.dumps(record).encode()


def _lone_surrogate(draw: Draw) -> bytes:
  """A question holding a UTF-16 surrogate escape with no partner (``"\\ud800"``): valid JSON,
  not a string any encoder can write."""
  record = draw(_RECORD)
  field = draw(st.sampled_from(["question", "answer"]))
  surrogate = draw(st.sampled_from(["\\ud800", "\\udfff", "\\udc00x"]))
  at = draw(st.integers(0, len(record[field])))
  text = json.dumps(record[field][:at])[1:-1] + surrogate + json.dumps(record[field][at:])[1:-1]
  record[field] = "@@"
  return json.dumps(record).replace('"@@"', f'"{text}"').encode()


def _empty_question(draw: Draw) -> bytes:
  record = draw(_RECORD)
  record["question"] = draw(st.sampled_from(["", " ", "\t", "\n\n", "\u3000"]))
  return json.dumps(record).encode()


def _huge_line(draw: Draw, ctx: dict) -> BadInput:
  """One question of megabytes: refused by its length before it is tokenized (bounded time)."""
  size = draw(st.sampled_from([1 << 20, 8 << 20, 50 << 20]))
  record = draw(_RECORD)
  record["question"] = "x" * size
  bad = _jsonl_with(draw, ctx, "huge_line", json.dumps(record).encode())
  return dataclasses.replace(bad, description=f"{size} chars", timeout_s=20.0)


def _empty_file(draw: Draw, ctx: dict) -> BadInput:
  path = os.path.join(ctx["folder"], "empty.jsonl")
  blank = st.lists(st.sampled_from(["", " ", "\t", "  \r"]), max_size=4)
  text = "\n".join(draw(blank)).encode()
  if draw(st.booleans()):
    text = b"\xef\xbb\xbf" + text  # a byte order mark only
  with open(path, "wb") as f:
    f.write(text)
  return BadInput(f"{path}: {text!r}", (path,), lambda: _load_prompts(ctx, path), True)


def _missing_file(draw: Draw, ctx: dict) -> BadInput:
  path = os.path.join(ctx["folder"], draw(st.sampled_from(["no_such_", "a_folder_"])) + "x")
  path += draw(IDENT)
  if "a_folder_" in path:
    os.makedirs(path, exist_ok=True)
  return BadInput(path, (path,), lambda: _load_prompts(ctx, path), True)


CASES: list[Case] = [
  *(
    (f.__name__.lstrip("_"), _line_case(f))
    for f in (
      _invalid_json,
      _not_utf8,
      _not_object,
      _missing_field,
      _non_string_field,
      _no_final_number,
      _too_long,
      _bad_char,
      _lone_surrogate,
      _empty_question,
    )
  ),
  ("huge_line", _huge_line),
  ("empty_file", _empty_file),
  ("missing_file", _missing_file),
]
