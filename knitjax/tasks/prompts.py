"""Prompt records and the resumable prompt stream every task feeds the rollout with.

The stream is a grain ``MapDataset``: the task's examples, shuffled with a seed and repeated
forever (each epoch gets a fresh permutation). Because a ``MapDataset`` is random access, the
stream's whole state is the index of the next prompt, so a checkpoint resumes exactly.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Prompt:
  """One task example, ready to sample from.

  Attributes:
    prompt_id: index of the example within its task (stable across epochs and resumes).
    cls: quota class of the prompt (its task or data source, e.g. ``"arith"``).
    text: the prompt text (a chat prompt: rendered by the chat template), without BOS.
    tokens: int32 prompt ids: BOS first for character-tokenizer tasks; a chat prompt holds what
      its template writes (Llama-3's <|begin_of_text|>, none for ChatML).
    answer: the reference answer the reward functions compare against.
    image: multimodal tasks: the prompt's image (uint8 [H, W, C]); None for text prompts.
  """

  prompt_id: int
  cls: str
  text: str
  tokens: np.ndarray
  answer: str
  image: np.ndarray | None = None

  def __post_init__(self):
    tokens = np.asarray(self.tokens)
    if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(
        f"Prompt.tokens must be a non-empty 1-D integer array, got shape {tokens.shape} "
        f"dtype {tokens.dtype}."
      )
    object.__setattr__(self, "tokens", tokens.astype(np.int32))


class PromptSource:
  """Endless, seeded stream of prompts over a task's examples; resumable via get/set_state."""

  def __init__(
    self,
    examples: Sequence[Prompt] | grain.MapDataset,
    *,
    seed: int,
    shuffle: bool = True,
  ):
    """Builds the stream.

    Args:
      examples: the task's examples (a sequence or a finite grain ``MapDataset`` of ``Prompt``).
      seed: shuffle seed; the same seed gives the same stream.
      shuffle: when False the examples repeat in their given order.
    """
    ds = examples if isinstance(examples, grain.MapDataset) else grain.MapDataset.source(examples)
    num_examples = len(ds)
    if num_examples == 0:
      raise ValueError("PromptSource needs at least one example, got none.")
    if shuffle:
      ds = ds.shuffle(seed=seed)
    self._ds = ds.repeat()
    self._seed = int(seed)
    self._shuffle = bool(shuffle)
    self._num_examples = num_examples
    self._next_index = 0

  @property
  def num_examples(self) -> int:
    """Number of distinct examples (one epoch)."""
    return self._num_examples

  def next(self, n: int) -> list[Prompt]:
    """Returns the next ``n`` prompts of the stream."""
    if n < 0:
      raise ValueError(f"n must be >= 0, got {n}.")
    start = self._next_index
    prompts = [self._ds[i] for i in range(start, start + n)]
    self._next_index = start + n
    return prompts

  def get_state(self) -> dict[str, Any]:
    """Returns a small dict of ints to store in a checkpoint."""
    return {
      "next_index": self._next_index,
      "seed": self._seed,
      "shuffle": int(self._shuffle),
      "num_examples": self._num_examples,
    }

  def set_state(self, state: dict[str, Any]) -> None:
    """Resumes from ``get_state()``; the stream must be built from the same examples and seed."""
    expected = {
      "seed": self._seed,
      "shuffle": int(self._shuffle),
      "num_examples": self._num_examples,
    }
    for key, value in expected.items():
      if key not in state or int(state[key]) != value:
        raise ValueError(
          f"prompt source state has {key}={state.get(key)!r} but this source has {key}={value}; "
          "resume with the same task, examples and seed."
        )
    next_index = int(state.get("next_index", -1))
    if next_index < 0:
      raise ValueError(
        f"prompt source state needs next_index >= 0, got {state.get('next_index')!r}."
      )
    self._next_index = next_index
