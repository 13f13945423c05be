"""Tests for knitjax.tasks.prompts."""

import grain
import numpy as np
import pytest

from knitjax.tasks import arith
from knitjax.tasks.prompts import Prompt, PromptSource
from knitjax.tasks.registry import make_prompt_source


def _ids(prompts):
  return [p.prompt_id for p in prompts]


def test_state_round_trip():
  src, _ = make_prompt_source("arith", seed=7)
  src.next(37)
  state = src.get_state()
  want = _ids(src.next(150))  # crosses an epoch boundary
  fresh, _ = make_prompt_source("arith", seed=7)
  fresh.set_state(dict(state))
  assert _ids(fresh.next(150)) == want


def test_epochs_are_permutations_and_reshuffled():
  src, _ = make_prompt_source("arith", seed=0)
  first, second = _ids(src.next(100)), _ids(src.next(100))
  assert sorted(first) == list(range(100)) and sorted(second) == list(range(100))
  assert first != second and first != list(range(100))
  other, _ = make_prompt_source("arith", seed=1)
  assert _ids(other.next(100)) != first
  same, _ = make_prompt_source("arith", seed=0)
  assert _ids(same.next(100)) == first


def test_unshuffled_and_map_dataset_input():
  examples = arith.make_examples(arith.make_tokenizer())
  src = PromptSource(examples, seed=0, shuffle=False)
  assert _ids(src.next(103)) == list(range(100)) + [0, 1, 2]
  from_ds = PromptSource(grain.MapDataset.source(examples), seed=3)
  from_list = PromptSource(examples, seed=3)
  assert _ids(from_ds.next(120)) == _ids(from_list.next(120))


def test_set_state_rejects_other_source():
  src, _ = make_prompt_source("arith", seed=0)
  other, _ = make_prompt_source("arith", seed=1)
  with pytest.raises(ValueError, match="seed=0 but this source has seed=1"):
    other.set_state(src.get_state())
  with pytest.raises(ValueError, match="next_index"):
    src.set_state({**src.get_state(), "next_index": -1})


def test_errors():
  with pytest.raises(ValueError, match="unknown task 'math'; choose one of: arith, gsm8k"):
    make_prompt_source("math", seed=0)
  with pytest.raises(ValueError, match="bad arguments"):
    make_prompt_source("gsm8k", seed=0)
  with pytest.raises(ValueError, match="at least one example"):
    PromptSource([], seed=0)
  with pytest.raises(ValueError, match="tokens"):
    Prompt(prompt_id=0, cls="x", text="", tokens=np.zeros((0,), np.int32), answer="")


def test_prompt_tokens_are_int32():
  p = Prompt(prompt_id=0, cls="x", text="a", tokens=np.array([1, 3]), answer="1")
  assert p.tokens.dtype == np.int32
