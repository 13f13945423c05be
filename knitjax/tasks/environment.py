"""The environment of a multi-turn task: what answers the model between its turns.

A multi-turn trajectory alternates model turns and environment turns. One :class:`Environment`
instance serves one trajectory (one sample of a group) and is deterministic given its prompt:

- ``reset(prompt) -> observation``: the text appended after the prompt before the first model
  turn ("" for none);
- ``step(action_text) -> (observation, reward, done)``: the model's turn as text, in, and the
  environment's answer, out. ``observation`` is appended to the trajectory (its tokens carry no
  loss), ``reward`` adds to the trajectory's reward, ``done`` ends the trajectory.

``action_text`` is the turn decoded with ``stop_at_eos=False``: a turn the model ended with the
end token ends in :data:`EOS_TEXT` (``CharTokenizer.decode``'s marker), a turn ended by one of the
task's stop texts (a tool call's closing token) ends in that text, and a turn cut by its token
budget ends in neither. The rollout (`knitjax.rollout.multiturn`) tokenizes observations, keeps
the budgets and turn limits, and ends a trajectory that runs out of them with the reward it has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from knitjax.tasks.prompts import Prompt

# How a decoded turn shows the end token (knitjax.tasks.tokenizer.CharTokenizer.decode).
EOS_TEXT = "<eos>"


@runtime_checkable
class Environment(Protocol):
  """One trajectory's environment (see the module docstring)."""

  def reset(self, prompt: Prompt) -> str:
    """Starts the trajectory of ``prompt``; returns the first observation ("" for none)."""

  def step(self, action_text: str) -> tuple[str, float, bool]:
    """Answers one model turn: ``(observation, reward, done)``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvironmentSpec:
  """What a multi-turn rollout needs from a task.

  Attributes:
    make: a fresh environment, one per trajectory.
    stop_texts: texts that end a model turn besides the end token (a tool call's closing
      token); each must encode to exactly one token.
  """

  make: Callable[[], Environment]
  stop_texts: tuple[str, ...] = ()
