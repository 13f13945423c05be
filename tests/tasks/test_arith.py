"""Tests for knitjax.tasks.arith: the answer depends on the prompt; constants score 0.10."""

import collections

import numpy as np
import pytest

from knitjax.tasks import arith
from knitjax.tasks.rewards import get_reward_fn

TOK = arith.make_tokenizer()
EXAMPLES = arith.make_examples(TOK)


def _completion(text, eos=True, pad=0):
  ids = TOK.encode(text, bos=False) + ([TOK.eos_id] if eos else [])
  return np.array(ids + [TOK.pad_id] * pad, np.int32)


def test_examples():
  assert TOK.vocab_size == 16
  assert len(EXAMPLES) == 100 and len({p.prompt_id for p in EXAMPLES}) == 100
  p = EXAMPLES[10 * 7 + 8]
  assert (p.text, p.answer, p.cls) == ("7 + 8 =", "5", "arith")
  assert p.tokens[0] == TOK.bos_id and TOK.decode(p.tokens) == "7 + 8 ="
  assert collections.Counter(p.answer for p in EXAMPLES) == {str(d): 10 for d in range(10)}


@pytest.mark.parametrize("reward", ["arith_first", "arith_exact"])
def test_any_constant_answer_scores_exactly_a_tenth(reward):
  fn = get_reward_fn(reward)
  for d in range(10):
    scores = [fn(p, _completion(str(d)), TOK) for p in EXAMPLES]
    assert np.mean(scores) == pytest.approx(0.10)
  assert np.mean([fn(p, _completion(p.answer), TOK) for p in EXAMPLES]) == 1.0


def test_first_vs_exact():
  first, exact = get_reward_fn("arith_first"), get_reward_fn("arith_exact")
  p = EXAMPLES[10 * 7 + 8]  # answer 5
  cases = {  # completion -> (arith_first, arith_exact)
    ("5", True, 0): (1.0, 1.0),
    ("5", True, 4): (1.0, 1.0),  # padded generation buffer
    ("5", False, 0): (1.0, 0.0),  # no EOS
    ("55", True, 0): (1.0, 0.0),
    ("4", True, 0): (0.0, 0.0),
    (" 5", True, 0): (0.0, 0.0),
    ("", True, 0): (0.0, 0.0),
  }
  for (text, eos, pad), want in cases.items():
    c = _completion(text, eos, pad)
    assert (first(p, c, TOK), exact(p, c, TOK)) == want, (text, eos, pad)
  assert first(p, np.zeros((0,), np.int32), TOK) == 0.0
  # After EOS nothing counts.
  assert exact(p, np.array(TOK.encode("5", bos=False) + [TOK.eos_id] + [5, 6]), TOK) == 1.0


def test_sum_class():
  examples = arith.make_examples(TOK, cls="sum")
  p = examples[10 * 7 + 8]
  assert (p.text, p.answer, p.cls, p.prompt_id) == ("7+8=", "15", "sum", 178)
  exact = get_reward_fn("arith_exact")
  assert exact(p, _completion("15"), TOK) == 1.0 and exact(p, _completion("1"), TOK) == 0.0
  texts = {q.text for q in examples} | {q.text for q in EXAMPLES}
  assert len(texts) == 200  # the classes never share a prompt
  with pytest.raises(ValueError, match="choose one of: arith, sum"):
    arith.make_examples(TOK, cls="mul")
