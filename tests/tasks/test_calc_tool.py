"""The calculator-tool task: problems, the calculator environment, its rewards, the registry."""

import numpy as np
import pytest

from knitjax.tasks import calc_tool
from knitjax.tasks.environment import EOS_TEXT, Environment
from knitjax.tasks.registry import make_environment, make_prompt_source
from knitjax.tasks.rewards import get_reward_fn


@pytest.fixture(scope="module")
def tokenizer():
  return calc_tool.make_tokenizer()


@pytest.fixture(scope="module")
def prompt(tokenizer):
  return next(p for p in calc_tool.make_examples(tokenizer) if p.text == "47*86")


def test_examples_cover_every_problem_with_a_four_digit_answer(tokenizer):
  examples = calc_tool.make_examples(tokenizer)
  assert len(examples) == 68 * 68 == len({p.prompt_id for p in examples})
  assert all(len(p.answer) == 4 and int(p.answer) == eval(p.text) for p in examples)
  assert tokenizer.vocab_size == 18
  assert examples[0].tokens.tolist() == [tokenizer.bos_id, *tokenizer.encode("32*32", bos=False)]
  with pytest.raises(ValueError, match="unknown calc_tool class"):
    calc_tool.make_examples(tokenizer, cls="arith")


@pytest.mark.parametrize(
  "expr, value",
  [
    ("47*86", 4042),
    ("2+3*4", 14),
    ("7", 7),
    ("1*2*3+4", 10),
    ("", None),
    ("4*", None),
    ("+1", None),
    ("1E2", None),
    ("C1", None),
  ],
)
def test_evaluate(expr, value):
  assert calc_tool.evaluate(expr) == value


def test_calculator_answers_calls_and_scores_the_final_answer(prompt):
  env = calc_tool.CalculatorEnv()
  assert isinstance(env, Environment)
  assert env.reset(prompt) == ""
  assert env.step("C4*=") == ("E", 0.0, False)  # malformed: an error, the trajectory goes on
  assert env.step("12=") == ("E", 0.0, False)  # a call must open with C
  assert env.step("C2+3=") == ("5", 0.0, False) and not env.called_right
  assert env.step("C=") == ("4042", 0.0, False) and env.called_right  # the problem's expression
  assert env.step("C86*47=") == ("4042", 0.0, False)
  assert env.step("4042" + EOS_TEXT) == ("", 1.0, True)


def test_partial_credit_only_after_a_right_call(prompt):
  env = calc_tool.CalculatorEnv()
  env.reset(prompt)
  assert env.step("4042") == ("", 0.0, True)  # no end token, no call: nothing
  env.reset(prompt)
  assert env.step("4000" + EOS_TEXT) == ("", 0.0, True)  # digits without the tool earn nothing
  env.reset(prompt)
  env.step("C=")
  obs, reward, done = env.step("4000" + EOS_TEXT)  # 2 of 4 digits and the end at their place
  assert done and reward == pytest.approx(calc_tool.CALL_CREDIT + calc_tool.DIGIT_CREDIT * 3 / 5)
  env.reset(prompt)
  env.step("C=")
  assert env.step("4042")[1] == pytest.approx(
    calc_tool.CALL_CREDIT + calc_tool.DIGIT_CREDIT * 4 / 5
  )
  env.reset(prompt)
  env.step("C=")  # the end token counts only right after the answer's length
  assert env.step("404" + EOS_TEXT)[1] == pytest.approx(
    calc_tool.CALL_CREDIT + calc_tool.DIGIT_CREDIT * 3 / 5
  )
  assert calc_tool.CALL_CREDIT + calc_tool.DIGIT_CREDIT < 1.0  # only the exact answer scores 1
  env.reset(prompt)  # reset forgets the call
  assert not env.called_right and env.step("0" + EOS_TEXT)[1] == 0.0


def test_step_before_reset_raises():
  with pytest.raises(RuntimeError, match="before reset"):
    calc_tool.CalculatorEnv().step("C=")


def test_answer_reward_needs_the_exact_answer_then_eos(prompt, tokenizer):
  reward = get_reward_fn("calc_answer")
  ids = np.asarray(tokenizer.encode("4042", bos=False))
  assert reward(prompt, np.append(ids, tokenizer.eos_id), tokenizer) == 1.0
  assert reward(prompt, ids, tokenizer) == 0.0
  assert reward(prompt, np.append(ids[:3], tokenizer.eos_id), tokenizer) == 0.0


def test_registry_gives_the_source_and_the_environment(tokenizer):
  source, tok = make_prompt_source("calc_tool", seed=0, cls="calc")
  assert source.num_examples == 68 * 68 and tok.alphabet == tokenizer.alphabet
  spec = make_environment("calc_tool")
  assert spec.stop_texts == ("=",) and isinstance(spec.make(), calc_tool.CalculatorEnv)
  assert spec.make() is not spec.make()  # one environment per trajectory
  with pytest.raises(ValueError, match="has no environment"):
    make_environment("arith")
