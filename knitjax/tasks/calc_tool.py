"""Calculator-tool task: multiply two 2-digit numbers, with a calculator the model may call.

Prompt ``BOS a*b`` with ``a, b`` in ``[32, 99]`` (4,624 problems; every product has 4 digits);
the answer is ``a * b``. A tiny policy from random init cannot learn 2-digit products by RL in a
few hundred steps, but it can learn to use the tool and copy its result:

  model turn 1:  ``C=``          a tool call (``C<expr>=``), ended by the stop token ``=``
  environment:   ``2236``        the calculator's result, appended (no loss on these tokens)
  model turn 2:  ``2236<eos>``   the final answer

Tool calls (:class:`CalculatorEnv`): a turn that ends with ``=`` is a call. ``C<expr>=`` with
``<expr>`` digits joined by ``+`` and ``*`` (``*`` binds first) returns the value; an empty
``<expr>`` means the problem's own expression (the calculator starts with the problem typed in,
so ``C=`` evaluates it); anything else returns ``E``. Any other turn is the final answer, which
ends the trajectory.

Reward (:class:`CalculatorEnv`, at the final answer): 1.0 for exactly the answer then the end
token (:func:`answer_reward`, registered as ``calc_answer``, scores that); otherwise, only when a
call returned the problem's value, ``CALL_CREDIT`` (0.2) plus ``DIGIT_CREDIT`` (0.4) x the
fraction of the answer's digits, and of the end token after them, that stand at their place;
otherwise 0. Why partial credit: for a
random policy a right call is a 1/18^2 event and exactly copying four digits and the end token a
1/18^5 one, so a group would almost never hold a success to learn from. The call credit makes
the call worth learning first; the digit credit then lets each copied digit (and the end token)
be learned on its own (like ``arith_first``). Digits count only after a right call, so guessing
digits without the tool earns nothing, and no partial credit reaches 1.0 (``solved_fraction`` in
the metrics counts the exact answers).
"""

from __future__ import annotations

import math
import re

import numpy as np

from knitjax.tasks.environment import EOS_TEXT, EnvironmentSpec
from knitjax.tasks.prompts import Prompt, PromptSource
from knitjax.tasks.tokenizer import CharTokenizer, split_at_eos

ALPHABET = "0123456789*+C=E"
CLASSES = ("calc",)
LOW, HIGH = 32, 99  # operand range: every product has 4 digits
CALL_OPEN, CALL_STOP, ERROR = "C", "=", "E"
CALL_CREDIT = 0.2
DIGIT_CREDIT = 0.4
_EXPR = re.compile(r"\d+([+*]\d+)*")


def make_tokenizer() -> CharTokenizer:
  """Returns the task's tokenizer (vocab_size 18)."""
  return CharTokenizer(ALPHABET)


def make_examples(tokenizer: CharTokenizer, *, cls: str = "calc") -> list[Prompt]:
  """All ``(a, b)`` problems of ``cls`` as prompts, in order."""
  if cls not in CLASSES:
    raise ValueError(f"unknown calc_tool class {cls!r}; choose one of: {', '.join(CLASSES)}.")
  n = HIGH - LOW + 1
  return [
    Prompt(
      prompt_id=(a - LOW) * n + (b - LOW),
      cls=cls,
      text=f"{a}*{b}",
      tokens=np.asarray(tokenizer.encode(f"{a}*{b}"), np.int32),
      answer=str(a * b),
    )
    for a in range(LOW, HIGH + 1)
    for b in range(LOW, HIGH + 1)
  ]


def make_source(
  *, seed: int, cls: str = "calc", shuffle: bool = True
) -> tuple[PromptSource, CharTokenizer]:
  """Returns (an endless PromptSource over the problems of ``cls``, the tokenizer)."""
  tokenizer = make_tokenizer()
  return PromptSource(make_examples(tokenizer, cls=cls), seed=seed, shuffle=shuffle), tokenizer


def evaluate(expr: str) -> int | None:
  """The value of ``expr`` (digits joined by ``+`` and ``*``, ``*`` first), or None if malformed."""
  if not _EXPR.fullmatch(expr):
    return None
  return sum(math.prod(int(x) for x in term.split("*")) for term in expr.split("+"))


def at_place(answer: str, text: str, *, ended: bool) -> float:
  """Fraction of the answer's characters, and of the end token after them, found at their place
  in ``text`` (``ended``: the end token came after ``text``)."""
  right = sum(a == b for a, b in zip(answer, text, strict=False))
  return (right + (ended and len(text) == len(answer))) / (len(answer) + 1)


def answer_reward(prompt: Prompt, completion_ids: np.ndarray, tokenizer: CharTokenizer) -> float:
  """1.0 when the completion is exactly the answer then EOS, else 0.0."""
  body, has_eos = split_at_eos(completion_ids, tokenizer.eos_ids)
  return float(has_eos and tokenizer.decode(body) == prompt.answer)


class CalculatorEnv:
  """One trajectory's calculator (the `knitjax.tasks.environment.Environment` interface).

  ``called_right`` says whether a call returned the problem's value.
  """

  def __init__(self):
    self._prompt: Prompt | None = None
    self.called_right = False

  def reset(self, prompt: Prompt) -> str:
    self._prompt, self.called_right = prompt, False
    return ""

  def step(self, action_text: str) -> tuple[str, float, bool]:
    if self._prompt is None:
      raise RuntimeError("CalculatorEnv.step before reset(prompt).")
    ended = action_text.endswith(EOS_TEXT)
    text = action_text[: -len(EOS_TEXT)] if ended else action_text
    if not ended and text.endswith(CALL_STOP):
      value = None
      if text.startswith(CALL_OPEN):
        value = evaluate(text[1:-1] or self._prompt.text)
      if value is None:
        return ERROR, 0.0, False
      self.called_right |= str(value) == self._prompt.answer
      return str(value), 0.0, False
    if ended and text == self._prompt.answer:
      return "", 1.0, True
    if not self.called_right:
      return "", 0.0, True
    return "", CALL_CREDIT + DIGIT_CREDIT * at_place(self._prompt.answer, text, ended=ended), True


def environment() -> EnvironmentSpec:
  """The calculator for the multi-turn rollout: one ``CalculatorEnv`` per trajectory, turns
  also end at ``=`` (a call's closing token)."""
  return EnvironmentSpec(make=CalculatorEnv, stop_texts=(CALL_STOP,))
