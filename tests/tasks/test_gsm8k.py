"""Tests for knitjax.tasks.gsm8k (each test writes its own small JSONL file)."""

import dataclasses
import json
import re

import numpy as np
import pytest

from knitjax.tasks import gsm8k, word_problems
from knitjax.tasks.registry import make_prompt_source
from knitjax.tasks.rewards import get_reward_fn

RECORDS = [
  {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
  {"question": "A car costs $1,200 more than $34. Cost?", "answer": "1200+34=1234\n#### 1,234"},
  {"question": "It is 2 degrees; it drops 7. Now?", "answer": "#### -5"},
  {"question": "Half of 7?", "answer": "#### 3.50"},
]


def _write(tmp_path, lines):
  path = tmp_path / "data.jsonl"
  path.write_text("\n".join(lines) + "\n")
  return str(path)


@pytest.fixture
def path(tmp_path):
  return _write(tmp_path, [json.dumps(r) for r in RECORDS])


def test_answer_notations(tmp_path):
  answers = ["#### 1e5", "#### 3/4", "#### $1,000", "#### 42.", "#### -2.5E-3"]
  lines = [json.dumps({"question": "q", "answer": a}) for a in answers]
  tok = gsm8k.make_tokenizer()
  examples = gsm8k.load_examples(_write(tmp_path, lines), tok)
  assert [p.answer for p in examples] == ["1e5", "3/4", "1000", "42", "-2.5E-3"]
  fn = get_reward_fn("numeric_match")
  for p, completion in zip(examples, ["100000", "0.75", "1000", "42", "-1/400"], strict=True):
    assert fn(p, np.array(tok.encode(completion, bos=False), np.int32), tok) == 1.0, p.answer


def test_reward_accepts_ids_beyond_the_tokenizer_vocab(path):
  """Regression: a model vocab larger than the tokenizer's (init_from) crashed the reward."""
  tok = gsm8k.make_tokenizer()
  p = gsm8k.load_examples(path, tok)[0]  # answer 7
  fn = get_reward_fn("numeric_match")
  model_vocab = 32_000
  rng = np.random.default_rng(0)
  for _ in range(20):
    ids = rng.integers(tok.vocab_size, model_vocab, size=16)
    assert fn(p, ids, tok) == 0.0
  seven, one, two = (tok.encode(c, bos=False)[0] for c in "712")
  oov = model_vocab - 1
  assert fn(p, np.array([oov, seven, oov]), tok) == 1.0
  assert fn(p, np.array([seven, oov, tok.eos_id]), tok) == 1.0
  # An unknown id separates digits rather than vanishing: "7<?>12" does not read as 712.
  p712 = dataclasses.replace(p, answer="712")
  assert fn(p712, np.array([seven, oov, one, two]), tok) == 0.0
  assert fn(p712, np.array([seven, one, two]), tok) == 1.0


def test_load(path):
  tok = gsm8k.make_tokenizer()
  examples = gsm8k.load_examples(path, tok)
  assert [p.answer for p in examples] == ["7", "1234", "-5", "3.50"]
  assert [p.prompt_id for p in examples] == [0, 1, 2, 3]
  p = examples[1]
  assert p.text == "Question: A car costs $1,200 more than $34. Cost?\nAnswer:"
  assert p.cls == "gsm8k" and p.tokens[0] == tok.bos_id and tok.decode(p.tokens) == p.text
  src, tok2 = make_prompt_source("gsm8k", seed=0, path=path)
  assert tok2.vocab_size == 99 and sorted(q.prompt_id for q in src.next(4)) == [0, 1, 2, 3]


def test_numeric_match(path):
  tok = gsm8k.make_tokenizer()
  ex = gsm8k.load_examples(path, tok)
  fn = get_reward_fn("numeric_match")

  def score(p, text, tail=()):
    return fn(p, np.array(tok.encode(text, bos=False) + list(tail), np.int32), tok)

  assert score(ex[0], " 3 + 4 = 7") == 1.0
  assert score(ex[0], " 7 apples, not 8") == 0.0  # the last number counts
  assert score(ex[1], " The answer is 1,234.") == 1.0
  assert score(ex[1], " 1234") == 1.0
  assert score(ex[2], " it is -5 degrees") == 1.0
  assert score(ex[2], " it is 5 degrees") == 0.0
  assert score(ex[3], " 3.5") == 1.0
  assert score(ex[3], " no idea") == 0.0
  assert score(ex[3], " 7/2") == 1.0  # values compare exactly, whatever the notation
  assert score(ex[3], " 3.5e0") == 1.0
  assert score(ex[1], " 1.234e3") == 1.0
  assert score(ex[1], " $1,234.") == 1.0
  # Text after EOS is ignored; EOS is not required.
  eos = tok.eos_id
  assert score(ex[0], " 7", tail=[eos, *tok.encode(" 9", bos=False)]) == 1.0
  assert score(ex[0], " 9", tail=[eos, *tok.encode(" 7", bos=False)]) == 0.0


@pytest.mark.parametrize(
  "lines, match",
  [
    (['{"question": "q", "answer": "#### 1"}', "{not json"], r"data.jsonl:2: invalid JSON"),
    (['{"question": "q"}'], r"data.jsonl:1: field 'answer' is missing"),
    (['{"question": 3, "answer": "#### 1"}'], r"data.jsonl:1: field 'question'"),
    (['{"question": "q", "answer": "7"}'], r"data.jsonl:1: answer must end in '#### <number>'"),
    (['{"question": "q", "answer": "#### seven"}'], r"data.jsonl:1: answer must end"),
    (['{"question": "caf\\u00e9?", "answer": "#### 1"}'], r"data.jsonl:1: character"),
    (["[1, 2]"], r"data.jsonl:1: expected a JSON object"),
    (['{"answer": "#### 1"}'], r"data.jsonl:1: field 'question' is missing"),
    (['{"question": "q", "answer": null}'], r"data.jsonl:1: field 'answer' is missing or not"),
    (['{"question": ["q"], "answer": "#### 1"}'], r"data.jsonl:1: field 'question'"),
    (['{"question": "q", "answer": "#### 1/0"}'], r"data.jsonl:1: answer must end"),
    (['{"question": "q", "answer": "#### 1e5000"}'], r"data.jsonl:1: answer must end"),
    (['{"question": "q", "answer": "#### 1"}', '"just a string"'], r"data.jsonl:2: expected"),
    (['{"question": "q", "answer": "#### 1"}', '{"question": 1' + "0" * 5000 + "}"], r":2: inv"),
    (["[" * 100_000 + "]" * 100_000], r"data.jsonl:1: invalid JSON"),
    ([""], r"holds no examples"),
    (["", "  ", ""], r"holds no examples"),
  ],
)
def test_load_errors(tmp_path, lines, match):
  path = _write(tmp_path, lines)
  with pytest.raises(ValueError, match=match):
    gsm8k.load_examples(path, gsm8k.make_tokenizer())


def test_empty_file(tmp_path):
  path = tmp_path / "empty.jsonl"
  path.write_bytes(b"")
  with pytest.raises(ValueError, match=r"empty.jsonl' holds no examples"):
    gsm8k.load_examples(str(path), gsm8k.make_tokenizer())


def test_not_utf8(tmp_path):
  path = tmp_path / "latin1.jsonl"
  good = json.dumps(RECORDS[0]).encode()
  path.write_bytes(good + b"\n" + '{"question": "caf\xe9", "answer": "#### 1"}'.encode("latin-1"))
  with pytest.raises(ValueError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 17"):
    gsm8k.load_examples(str(path), gsm8k.make_tokenizer())


def test_utf8_byte_order_mark_is_accepted(tmp_path):
  path = tmp_path / "bom.jsonl"
  path.write_bytes(b"\xef\xbb\xbf" + json.dumps(RECORDS[0]).encode() + b"\r\n")
  assert [p.answer for p in gsm8k.load_examples(str(path), gsm8k.make_tokenizer())] == ["7"]


def test_prompt_length_limit(tmp_path):
  tok = gsm8k.make_tokenizer()
  overhead = len(gsm8k.TEMPLATE.format(question="")) + 1  # template and BOS
  fits = json.dumps({"question": "x" * (32 - overhead), "answer": "#### 1"})
  over = json.dumps({"question": "x" * (33 - overhead), "answer": "#### 1"})
  examples = gsm8k.load_examples(_write(tmp_path, [fits]), tok, max_prompt_tokens=32)
  assert len(examples[0].tokens) == 32
  path = _write(tmp_path, [fits, over])
  with pytest.raises(
    ValueError, match=r"data.jsonl:2: the prompt is 33 tokens long, over the limit of 32 "
  ):
    gsm8k.load_examples(path, tok, max_prompt_tokens=32)
  # The limit reaches the task through the registry, and the default is MAX_PROMPT_TOKENS.
  with pytest.raises(ValueError, match=r"over the limit of 32"):
    make_prompt_source("gsm8k", seed=0, path=path, max_prompt_tokens=32)
  source, _ = make_prompt_source("gsm8k", seed=0, path=path)
  assert source.num_examples == 2 and gsm8k.MAX_PROMPT_TOKENS == 4096


def test_huge_question_is_rejected_without_tokenizing_it(tmp_path):
  """A 10 MB question used to become a 10M-token prompt_len for every prompt buffer."""
  huge = json.dumps({"question": "7" * 10_000_000, "answer": "#### 1"})
  path = _write(tmp_path, [json.dumps(RECORDS[0]), huge])
  tok = gsm8k.make_tokenizer()
  encoded = []
  encode = tok.encode
  tok.encode = lambda text, **kw: encoded.append(len(text)) or encode(text, **kw)
  with pytest.raises(
    ValueError, match=r"data.jsonl:2: the question is 10,000,000 characters long, more than a "
    r"prompt of 4096 tokens \(max_prompt_tokens\) can hold at 256 characters a token"
  ):  # fmt: skip
    gsm8k.load_examples(path, tok)
  assert max(encoded) < 100  # the length is checked before the question is encoded
  # Under the character bound, the token count decides (free for the character tokenizer).
  path = _write(tmp_path, [json.dumps({"question": "7" * 5000, "answer": "#### 1"})])
  with pytest.raises(ValueError, match=r"data.jsonl:1: the prompt is 5019 tokens long, over"):
    gsm8k.load_examples(path, tok)


class _CountingTokenizer:
  """A chat tokenizer that records every text it is asked to render, count or encode."""

  def __init__(self):
    self.inner, self.seen = FakeChatTokenizer(), []
    self.chat_template = self.inner.chat_template
    self.pad_id, self.bos_id, self.eos_id, self.eos_ids = 0, 1, 2, (2, 3)

  def apply_chat_template(self, messages, **kw):
    self.seen.append(sum(len(m["content"]) for m in messages))
    return self.inner.apply_chat_template(messages, **kw)

  def num_tokens(self, text, *, bos=True):
    self.seen.append(len(text))
    return self.inner.num_tokens(text, bos=bos)

  def encode(self, text, *, bos=True):
    self.seen.append(len(text))
    return self.inner.encode(text, bos=bos)


def test_a_50_mb_question_is_refused_before_rendering_or_tokenizing(tmp_path):
  huge = json.dumps({"question": "seven " * 9_000_000, "answer": "#### 7"})
  path = _write(tmp_path, [json.dumps(RECORDS[0]), huge])
  tok = _CountingTokenizer()
  with pytest.raises(ValueError, match=r"data.jsonl:2: the question is 54,000,000 characters"):
    gsm8k.load_examples(path, tok)
  assert max(tok.seen) < 1000


@pytest.mark.parametrize(
  "line, match",
  [
    ('{"question": "Half of \\ud800?", "answer": "#### 1"}',
     r"data.jsonl:2: field 'question' holds a lone surrogate \(U\+D800 at character 8\); "
     r"accepted: valid Unicode text\.$"),
    ('{"question": "q?", "answer": "#### 1 \\udfff"}',
     r"data.jsonl:2: field 'answer' holds a lone surrogate \(U\+DFFF at character 7\)"),
    ('{"question": "", "answer": "#### 1"}', r"data.jsonl:2: field 'question' is empty"),
    ('{"question": " \\n\\t ", "answer": "#### 1"}', r"data.jsonl:2: field 'question' is empty"),
  ],
)  # fmt: skip
def test_bad_questions_name_file_and_line(tmp_path, line, match):
  path = _write(tmp_path, [json.dumps(RECORDS[0]), line])
  for tok in (gsm8k.make_tokenizer(), FakeChatTokenizer()):
    with pytest.raises(ValueError, match=match):
      gsm8k.load_examples(path, tok)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "64", True])
def test_max_prompt_tokens_must_be_a_positive_int(path, bad):
  with pytest.raises(ValueError, match=r"max_prompt_tokens must be an integer >= 1"):
    gsm8k.load_examples(path, gsm8k.make_tokenizer(), max_prompt_tokens=bad)


def test_missing_file(tmp_path):
  with pytest.raises(ValueError, match="nope.jsonl.*does not exist"):
    make_prompt_source("gsm8k", seed=0, path=str(tmp_path / "nope.jsonl"))
  with pytest.raises(ValueError, match="is not a regular file"):
    gsm8k.load_examples(str(tmp_path), gsm8k.make_tokenizer())


def test_blank_lines_skipped(tmp_path):
  path = _write(tmp_path, ["", json.dumps(RECORDS[0]), "   ", json.dumps(RECORDS[2])])
  assert len(gsm8k.load_examples(path, gsm8k.make_tokenizer())) == 2


def test_char_tokenizer_prompt_is_unchanged(tmp_path):
  """Golden: the character-tokenizer prompt (text and ids) that runs and checkpoints rely on."""
  path = _write(tmp_path, [json.dumps({"question": "2+3?", "answer": "#### 5"})])
  (p,) = make_prompt_source("gsm8k", seed=0, path=path)[0].next(1)
  assert p.text == "Question: 2+3?\nAnswer:"
  assert p.tokens.tolist() == [
    1, 53, 89, 73, 87, 88, 77, 83, 82, 30, 4, 22, 15, 23, 35, 3, 37, 82, 87, 91, 73, 86, 30
  ]  # fmt: skip


# ---- Hugging Face `datasets` exports: JSONL and parquet --------------------------------------


def test_datasets_jsonl_export_with_extra_fields(tmp_path):
  # Dataset.to_json writes pandas' JSON: escaped slashes and non-ASCII, extra columns.
  lines = [
    '{"question":"Half of 1\\/2?","answer":"1\\/2 \\/ 2 = 1\\/4\\n#### 1\\/4","idx":0}',
    '{"id":"b","question":"Cost?","answer":"#### 3","meta":{"split":"train"}}',
  ]
  examples = gsm8k.load_examples(_write(tmp_path, lines), gsm8k.make_tokenizer())
  assert [(p.text, p.answer) for p in examples] == [
    ("Question: Half of 1/2?\nAnswer:", "1/4"),
    ("Question: Cost?\nAnswer:", "3"),
  ]


def _write_parquet(path, columns):
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  pq.write_table(pa.table(columns), path, row_group_size=2)  # several row groups
  return str(path)


@pytest.mark.parametrize("name", ["train-00000-of-00001.parquet", "export.PARQUET", "no_suffix"])
def test_parquet(tmp_path, name):
  pa = pytest.importorskip("pyarrow")
  path = _write_parquet(
    tmp_path / name,
    {
      "question": pa.array([r["question"] for r in RECORDS], pa.large_string()),
      "answer": [r["answer"] for r in RECORDS],
      "extra": list(range(len(RECORDS))),
    },
  )
  tok = gsm8k.make_tokenizer()
  examples = gsm8k.load_examples(path, tok)
  assert [p.answer for p in examples] == ["7", "1234", "-5", "3.50"]
  assert examples[1].text == "Question: A car costs $1,200 more than $34. Cost?\nAnswer:"
  assert tok.decode(examples[1].tokens) == examples[1].text
  src, _ = make_prompt_source("gsm8k", seed=0, path=path)
  assert src.num_examples == 4


@pytest.mark.parametrize(
  "columns, match",
  [
    ({"question": ["q", "q"], "answer": ["#### 1", None]}, r"x.parquet:row 1: field 'answer' is"),
    ({"question": ["q", "q", 3], "answer": ["#### 1"] * 3}, r"not a readable parquet"),
    ({"question": ["q", "q", "q"], "answer": ["#### 1", "#### 2", "3"]}, r":row 2: answer must"),
    ({"question": [1, 2], "answer": ["#### 1", "#### 2"]}, r"x.parquet:row 0: field 'question'"),
    ({"q": ["q"], "answer": ["#### 1"]}, r"no column 'question' \(its columns: q, answer\)"),
    ({"question": [], "answer": []}, r"holds no examples"),
  ],
)
def test_parquet_errors(tmp_path, columns, match):
  pa = pytest.importorskip("pyarrow")
  if columns.get("question") == []:
    columns = {k: pa.array([], pa.string()) for k in columns}
  try:
    path = _write_parquet(tmp_path / "x.parquet", columns)
  except pa.ArrowException:  # a mixed column pyarrow refuses to write: write its bytes instead
    path = tmp_path / "x.parquet"
    path.write_bytes(b"PAR1 not really parquet")
    path = str(path)
  with pytest.raises(ValueError, match=match):
    gsm8k.load_examples(path, gsm8k.make_tokenizer())


def test_corrupt_parquet_and_missing_pyarrow(tmp_path, monkeypatch):
  path = tmp_path / "data.parquet"
  path.write_text('{"question": "q", "answer": "#### 1"}\n')
  with pytest.raises(ValueError, match=r"data.parquet' is not a readable parquet file"):
    gsm8k.load_examples(str(path), gsm8k.make_tokenizer())
  monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)  # import pyarrow fails
  with pytest.raises(ValueError) as e:
    gsm8k.load_examples(str(path), gsm8k.make_tokenizer())
  assert str(e.value) == (
    f"GSM8K file {str(path)!r} is parquet, which needs pyarrow; pip install pyarrow."
  )


# ---- generated word problems ------------------------------------------------------------------


def test_generated_train_and_heldout():
  train, tok = make_prompt_source("gsm8k", seed=0, path="generated:train", shuffle=False)
  heldout = gsm8k.load_examples("generated:heldout", tok, cls="eval")
  assert (train.num_examples, len(heldout)) == (4096, 512)
  train_prompts = train.next(train.num_examples)
  assert {p.text for p in train_prompts}.isdisjoint(p.text for p in heldout)
  records = word_problems.fixed_split("heldout")
  assert heldout[0].text == f"Question: {records[0]['question']}\nAnswer:"
  assert [p.answer for p in heldout] == [r["answer"].rpartition("#### ")[2] for r in records]
  assert heldout[0].cls == "eval" and tok.vocab_size == 99
  with pytest.raises(ValueError, match=r"unknown generated data 'generated:test'; choose one of: "):
    gsm8k.load_examples("generated:test", tok)


# ---- prompts through a real (here fake) tokenizer with a chat template -----------------------


class FakeChatTokenizer:
  """ChatML-like stand-in for knitjax.models.hf_tokenizer.HFTokenizer.

  Ids: pad 0, bos 1, eos 2, <|im_end|> 3 (also a stop id), <|im_start|> 4, then ord(c) + 5.
  """

  pad_id, bos_id, eos_id, eos_ids = 0, 1, 2, (2, 3)
  vocab_size = 128 + 5
  _SPECIAL = {"<|im_end|>": 3, "<|im_start|>": 4}

  def __init__(self, chat_template="{% chatml %}"):
    self.chat_template = chat_template

  def apply_chat_template(self, messages, *, add_generation_prompt=True, tokenize=False):
    assert not tokenize
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

  def encode(self, text, *, bos=True):
    ids = [self.bos_id] if bos else []
    for piece in re.split(r"(<\|im_(?:start|end)\|>)", text):
      ids += [self._SPECIAL[piece]] if piece in self._SPECIAL else [ord(c) + 5 for c in piece]
    return ids

  def num_tokens(self, text, *, bos=True):
    return len(self.encode(text, bos=bos))

  def decode(self, ids, *, stop_at_eos=True):
    out, names = [], {v: k for k, v in self._SPECIAL.items()}
    for t in np.asarray(ids).reshape(-1).tolist():
      if t in self.eos_ids and stop_at_eos:
        break
      out.append(names.get(t, "<eos>" if t == 2 else "") if t < 5 else chr(t - 5))
    return "".join(out)


def _chars(text):
  return [ord(c) + 5 for c in text]


def test_chat_prompt_text_and_ids(path):
  tok = FakeChatTokenizer()
  examples = gsm8k.load_examples(path, tok, system_prompt="Be brief.")
  p = examples[0]
  user = "Tom has 3 apples and buys 4. How many?\n\n" + gsm8k.INSTRUCTION
  assert gsm8k.INSTRUCTION == (
    "Solve the problem step by step and give the final answer after '####'."
  )
  assert p.text == (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    f"<|im_start|>user\n{user}<|im_end|>\n"
    "<|im_start|>assistant\n"
  )
  # Encoded without BOS: the template's text is the whole prompt.
  assert p.tokens.tolist() == [
    4, *_chars("system\nBe brief."), 3, *_chars("\n"),
    4, *_chars("user\n" + user), 3, *_chars("\n"),
    4, *_chars("assistant\n"),
  ]  # fmt: skip
  assert p.answer == "7"
  # No system prompt, no instruction; the source hands back the tokenizer it was given.
  source, tok2 = gsm8k.make_source(seed=0, path=path, tokenizer=tok, instruction="", shuffle=False)
  assert tok2 is tok
  assert source.next(1)[0].text == (
    "<|im_start|>user\nTom has 3 apples and buys 4. How many?<|im_end|>\n<|im_start|>assistant\n"
  )


def test_plain_prompts_with_a_tokenizer(path):
  # chat=False (or a tokenizer without a template): "Question: ...\nAnswer:" with BOS.
  for tok, chat in [(FakeChatTokenizer(), False), (FakeChatTokenizer(chat_template=None), None)]:
    p = gsm8k.load_examples(path, tok, chat=chat)[0]
    assert p.text == "Question: Tom has 3 apples and buys 4. How many?\nAnswer:"
    assert p.tokens.tolist() == [1, *_chars(p.text)]


def test_chat_errors(path):
  with pytest.raises(ValueError, match=r"chat=True needs a tokenizer with a chat template, but "):
    gsm8k.load_examples(path, gsm8k.make_tokenizer(), chat=True)
  with pytest.raises(ValueError, match=r"chat=True needs a tokenizer with a chat template"):
    gsm8k.make_source(seed=0, path=path, tokenizer=FakeChatTokenizer(None), chat=True)
  with pytest.raises(ValueError, match=r"system_prompt='x' needs chat prompts, but chat is off"):
    gsm8k.make_source(seed=0, path=path, system_prompt="x")


def test_chat_prompt_length_limit(path):
  tok = FakeChatTokenizer()
  longest = max(len(p.tokens) for p in gsm8k.load_examples(path, tok))
  assert len(gsm8k.load_examples(path, tok, max_prompt_tokens=longest)) == 4
  with pytest.raises(ValueError, match=rf"data.jsonl:\d: the prompt is {longest} tokens long"):
    gsm8k.load_examples(path, tok, max_prompt_tokens=longest - 1)


def test_heldout_set_names_for_eval_metric_keys():
  assert gsm8k.set_name("generated:one_step:heldout_phrasings") == "heldout_phrasings"
  assert gsm8k.set_name("generated:heldout") == "heldout"
  assert gsm8k.set_name("/data/GSM8K test-v2.jsonl") == "gsm8k_test_v2"
  assert gsm8k.set_name("main/test-00000-of-00001.parquet") == "test_00000_of_00001"
  with pytest.raises(ValueError, match=r"unknown generated data 'generated:nope'"):
    gsm8k.set_name("generated:nope")
