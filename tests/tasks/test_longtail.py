"""Tests for knitjax.tasks.longtail (two classes, long-tail response lengths)."""

import numpy as np
import pytest

from knitjax.tasks import longtail
from knitjax.tasks.registry import make_prompt_source
from knitjax.tasks.rewards import get_reward_fn


def _ids(tok, text, eos=True):
  return np.array(tok.encode(text, bos=False) + ([tok.eos_id] if eos else []), np.int32)


def test_classes_prompts_and_unique_ids():
  source, tok = make_prompt_source("longtail", seed=0, cls="think", shuffle=False)
  think = source.next(100)
  arith = longtail.make_examples(tok, cls="arith")
  assert think[37].text == "3+7=" and think[37].answer == "0" and think[37].cls == "think"
  assert arith[37].text == "3 + 7 =" and arith[37].answer == "0"
  ids = {p.prompt_id for p in think} | {p.prompt_id for p in arith}
  assert len(ids) == 200
  with pytest.raises(ValueError, match="unknown longtail class 'sum'"):
    longtail.make_examples(tok, cls="sum")


def test_think_reward_wants_the_answer_just_before_eos():
  source, tok = make_prompt_source("longtail", seed=0, cls="think", shuffle=False)
  p = source.next(38)[37]  # 3+7=, answer 0
  reward = get_reward_fn("longtail")
  assert reward(p, _ids(tok, "0"), tok) == 1.0
  assert reward(p, _ids(tok, "12+= 90"), tok) == 1.0  # any "thinking" first
  assert reward(p, _ids(tok, "09"), tok) == 0.0  # the last token counts
  assert reward(p, _ids(tok, "0", eos=False), tok) == 0.0  # no EOS: no answer
  assert reward(p, np.array([tok.eos_id], np.int32), tok) == 0.0
  # Padding after the EOS is ignored (whole generation buffer).
  padded = np.concatenate([_ids(tok, "5 0"), np.zeros(5, np.int32)])
  assert reward(p, padded, tok) == 1.0


def test_arith_class_is_exact():
  _, tok = make_prompt_source("longtail", seed=0, cls="arith")
  p = longtail.make_examples(tok, cls="arith")[37]
  reward = get_reward_fn("longtail")
  assert reward(p, _ids(tok, "0"), tok) == 1.0
  assert reward(p, _ids(tok, " 0"), tok) == 0.0


def test_constant_answer_scores_a_tenth():
  _, tok = make_prompt_source("longtail", seed=0, cls="think")
  reward = get_reward_fn("longtail")
  for cls in longtail.CLASSES:
    prompts = longtail.make_examples(tok, cls=cls)
    assert np.mean([reward(p, _ids(tok, "4"), tok) for p in prompts]) == pytest.approx(0.1)
