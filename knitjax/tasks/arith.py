"""Synthetic arithmetic task: read two digits, answer their sum.

Class ``"arith"``: prompt ``BOS a + b =``, answer ``(a + b) mod 10`` (one digit). The answer depends
on both digits and every residue occurs exactly 10 times in the 100 pairs, so any constant answer
scores exactly 0.10 and the policy has to read the prompt.

Class ``"sum"`` (a second quota class for later issues): prompt ``BOS a+b=`` (no spaces, so the
policy can tell the classes apart), answer the full sum ``a + b`` (one or two digits).

Both classes share one 16-token vocabulary: pad, bos, eos, the ten digits, space, ``+`` and ``=``.
"""

import numpy as np

from knitjax.tasks.prompts import Prompt, PromptSource
from knitjax.tasks.tokenizer import CharTokenizer, split_at_eos

ALPHABET = "0123456789 +="
CLASSES = ("arith", "sum")
# prompt_id = offset + 10 * a + b keeps ids unique when both classes are served.
_ID_OFFSET = {"arith": 0, "sum": 100}


def make_tokenizer() -> CharTokenizer:
  """Returns the task's tokenizer (vocab_size 16)."""
  return CharTokenizer(ALPHABET)


def make_examples(tokenizer: CharTokenizer, *, cls: str = "arith") -> list[Prompt]:
  """Returns all 100 (a, b) digit pairs of class ``cls`` as prompts, in order."""
  if cls not in CLASSES:
    raise ValueError(f"unknown arith class {cls!r}; choose one of: {', '.join(CLASSES)}.")
  examples = []
  for a in range(10):
    for b in range(10):
      if cls == "arith":
        text, answer = f"{a} + {b} =", str((a + b) % 10)
      else:
        text, answer = f"{a}+{b}=", str(a + b)
      examples.append(
        Prompt(
          prompt_id=_ID_OFFSET[cls] + 10 * a + b,
          cls=cls,
          text=text,
          tokens=np.asarray(tokenizer.encode(text), np.int32),
          answer=answer,
        )
      )
  return examples


def make_source(
  *, seed: int, cls: str = "arith", shuffle: bool = True
) -> tuple[PromptSource, CharTokenizer]:
  """Returns (an endless PromptSource over the 100 pairs of ``cls``, the tokenizer)."""
  tokenizer = make_tokenizer()
  return PromptSource(make_examples(tokenizer, cls=cls), seed=seed, shuffle=shuffle), tokenizer


def first_token_reward(
  prompt: Prompt, completion_ids: np.ndarray, tokenizer: CharTokenizer
) -> float:
  """1.0 when the first generated token is the first character of the answer, else 0.0."""
  ids = np.asarray(completion_ids).reshape(-1)
  want = tokenizer.encode(prompt.answer[:1], bos=False)[0]
  return float(ids.size > 0 and int(ids[0]) == want)


def exact_reward(prompt: Prompt, completion_ids: np.ndarray, tokenizer: CharTokenizer) -> float:
  """1.0 when the completion is exactly the answer followed by EOS, else 0.0."""
  body, has_eos = split_at_eos(completion_ids, tokenizer.eos_id)
  want = tokenizer.encode(prompt.answer, bos=False)
  return float(has_eos and body.tolist() == want)
