"""Tests for knitjax.tasks.rewards (the registry)."""

import numpy as np
import pytest

from knitjax.tasks import rewards
from knitjax.tasks.registry import make_prompt_source

# reward -> (task, task kwargs); gsm8k's kwargs get a path in the test.
_TASK_OF = {
  "arith_first": ("arith", {"cls": "arith"}),
  "arith_exact": ("arith", {"cls": "sum"}),
  "numeric_match": ("gsm8k", {}),
  "math": ("gsm8k", {}),
  "longtail": ("longtail", {"cls": "think"}),
  "count_exact": ("count_images", {"num_examples": 10}),
  "calc_answer": ("calc_tool", {}),
}


def test_registry():
  assert set(rewards.REWARDS) == {
    "arith_first",
    "arith_exact",
    "numeric_match",
    "math",
    "longtail",
    "count_exact",
    "calc_answer",
  }
  for name, fn in rewards.REWARDS.items():
    assert rewards.get_reward_fn(name) is fn


def test_unknown_reward():
  with pytest.raises(ValueError) as e:
    rewards.get_reward_fn("x")
  assert (
    str(e.value)
    == "unknown reward 'x'; choose one of: arith_first, arith_exact, numeric_match, math, "
    "longtail, count_exact, calc_answer"
  )


@pytest.mark.parametrize("name", sorted(_TASK_OF))
def test_every_reward_accepts_any_id_of_a_larger_model_vocab(name, tmp_path):
  """Ids in [0, model vocab) with model vocab > tokenizer vocab (an init_from model)."""
  assert set(_TASK_OF) == set(rewards.REWARDS)
  task, kwargs = _TASK_OF[name]
  if task == "gsm8k":
    path = tmp_path / "data.jsonl"
    path.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n')
    kwargs = {"path": str(path)}
  source, tok = make_prompt_source(task, seed=0, **kwargs)
  fn = rewards.get_reward_fn(name)
  model_vocab = 50_000
  rng = np.random.default_rng(0)
  for prompt in source.next(10):
    answer = tok.encode(prompt.answer, bos=False)
    oov = rng.integers(tok.vocab_size, model_vocab, size=8)
    assert fn(prompt, oov, tok) == 0.0
    assert fn(prompt, np.concatenate([oov, [tok.eos_id]]), tok) == 0.0
    mixed = rng.integers(0, model_vocab, size=(20, 12))
    assert {fn(prompt, ids, tok) for ids in mixed} <= {0.0, 1.0}
    # Unknown ids after the EOS are ignored by every reward.
    right = np.array(answer + [tok.eos_id, model_vocab - 1, tok.vocab_size])
    assert fn(prompt, right, tok) == 1.0, (name, prompt.answer)
