"""Two-class arithmetic with a long-tail response-length mix, for the staleness benchmarks.

Class ``"arith"`` is `knitjax.tasks.arith`'s: prompt ``BOS a + b =``, answer ``(a + b) mod 10``
then EOS (a short response, 2 tokens when right).

Class ``"think"``: prompt ``BOS a+b=`` (no spaces, so the policy can tell the classes apart); the
response may hold any tokens ("thinking") before its answer, and is right when the token just
before its first EOS is ``(a + b) mod 10``. Its length is the policy's choice, bounded by the
class's token budget (``config.rollout.class_max_new_tokens``), so the response lengths of a
mostly untrained policy have a long tail up to that budget, while ``arith`` responses stay short:
groups of the two classes finish out of order, as long reasoning traces do in production.

Both classes use the 16-token vocabulary of `knitjax.tasks.arith`, and every residue occurs 10
times in the 100 pairs, so a constant answer scores 0.10 on either class.
"""

import numpy as np

from knitjax.tasks import arith
from knitjax.tasks.prompts import Prompt, PromptSource
from knitjax.tasks.tokenizer import CharTokenizer, split_at_eos

CLASSES = ("arith", "think")
_THINK_ID_OFFSET = 200  # apart from arith's ids (0..199), so both classes' ids stay unique


def make_examples(tokenizer: CharTokenizer, *, cls: str) -> list[Prompt]:
  """Returns the 100 (a, b) digit pairs of class ``cls`` as prompts, in order."""
  if cls == "arith":
    return arith.make_examples(tokenizer, cls="arith")
  if cls != "think":
    raise ValueError(f"unknown longtail class {cls!r}; choose one of: {', '.join(CLASSES)}.")
  out = []
  for a in range(10):
    for b in range(10):
      text = f"{a}+{b}="
      out.append(
        Prompt(
          prompt_id=_THINK_ID_OFFSET + 10 * a + b,
          cls="think",
          text=text,
          tokens=np.asarray(tokenizer.encode(text), np.int32),
          answer=str((a + b) % 10),
        )
      )
  return out


def make_source(
  *, seed: int, cls: str = "arith", shuffle: bool = True
) -> tuple[PromptSource, CharTokenizer]:
  """Returns (an endless PromptSource over the 100 pairs of ``cls``, the tokenizer)."""
  tokenizer = arith.make_tokenizer()
  return PromptSource(make_examples(tokenizer, cls=cls), seed=seed, shuffle=shuffle), tokenizer


def answer_last_reward(
  prompt: Prompt, completion_ids: np.ndarray, tokenizer: CharTokenizer
) -> float:
  """1.0 when an EOS was produced and the token just before it is the answer digit."""
  body, has_eos = split_at_eos(completion_ids, tokenizer.eos_id)
  want = tokenizer.encode(prompt.answer, bos=False)
  return float(has_eos and body.size >= len(want) and body[-len(want) :].tolist() == want)


def reward(prompt: Prompt, completion_ids: np.ndarray, tokenizer: CharTokenizer) -> float:
  """``arith``: exactly the answer then EOS; ``think``: anything, then the answer, then EOS."""
  if prompt.cls == "think":
    return answer_last_reward(prompt, completion_ids, tokenizer)
  return arith.exact_reward(prompt, completion_ids, tokenizer)
