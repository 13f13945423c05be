"""Per-class prompt streams: one resumable `PromptSource` per quota class (docs/glossary.md)."""

from __future__ import annotations

import dataclasses

from knitjax.tasks.prompts import Prompt, PromptSource
from knitjax.tasks.tokenizer import CharTokenizer


@dataclasses.dataclass
class ClassStreams:
  """One prompt stream per quota class, the tokenizer they share, and the padded prompt length."""

  sources: dict[str, PromptSource]
  tokenizer: CharTokenizer
  prompt_len: int

  def next(self, counts: dict[str, int]) -> list[Prompt]:
    """The next ``counts[cls]`` prompts of each class, classes in the order given."""
    out = []
    for cls, n in counts.items():
      if n:
        out += self.sources[cls].next(n)
    return out

  def state_dict(self) -> dict:
    return {cls: s.get_state() for cls, s in self.sources.items()}

  def load_state_dict(self, state: dict) -> None:
    for cls, s in self.sources.items():
      s.set_state(state[cls])
