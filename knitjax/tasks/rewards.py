"""Registry of reward functions (verifiers), chosen by name in configs.

Signature, the one the runtime calls::

    fn(prompt: Prompt, completion_ids: np.ndarray, tokenizer) -> float

``tokenizer`` is the task's `CharTokenizer` or a checkpoint's `HFTokenizer` (same interface).

``completion_ids`` is the 1-D int array of tokens sampled after the prompt: either trimmed to the
completion's length (the EOS, when produced, is its last token) or the whole padded generation
buffer. Rewards look only up to the first EOS, so both forms give the same reward; an EOS was
produced iff one of ``tokenizer.eos_ids`` occurs in ``completion_ids``. Token ids rather than
decoded text are passed so that a reward can require the EOS (``arith_exact``) or look at single
tokens (``arith_first``). The ids may be any the model can sample, ``[0, config.model.vocab_size)``,
which can exceed ``tokenizer.vocab_size`` (an ``init_from`` model): every reward accepts them, and
an id beyond the tokenizer's vocabulary never matches an answer (`CharTokenizer.decode`).

Rewards:
  arith_first: 1.0 when the first generated token is the (first) answer digit; EOS not required.
  arith_exact: 1.0 when the completion is exactly the answer then EOS.
  numeric_match: 1.0 when the last number before EOS equals the answer's number (GSM8K-style);
    EOS not required.
  math: numeric_match plus 0.1 x a format reward (an EOS, and exactly one '#### <number>' line);
    a right answer scores at least 1.0 (real-text recipes, configs/smollm2_math.py).
  longtail: class ``arith`` as arith_exact; class ``think``: 1.0 when the token just before the
    first EOS is the answer digit (any tokens may come before it).
  count_exact: 1.0 when the completion is exactly the shape count then EOS (count_images).
  calc_answer: 1.0 when the completion is exactly the product then EOS (calc_tool's final
    answer; its environment adds partial credit after a right tool call).
"""

from collections.abc import Callable

import numpy as np

from knitjax.tasks import arith, calc_tool, count_images, longtail, math_verifier
from knitjax.tasks.prompts import Prompt
from knitjax.tasks.tokenizer import CharTokenizer

RewardFn = Callable[[Prompt, np.ndarray, CharTokenizer], float]

REWARDS: dict[str, RewardFn] = {
  "arith_first": arith.first_token_reward,
  "arith_exact": arith.exact_reward,
  "numeric_match": math_verifier.numeric_match_reward,
  "math": math_verifier.math_reward,
  "longtail": longtail.reward,
  "count_exact": count_images.exact_reward,
  "calc_answer": calc_tool.answer_reward,
}


def get_reward_fn(name: str) -> RewardFn:
  """Returns the reward function registered as ``name``."""
  if name not in REWARDS:
    raise ValueError(f"unknown reward {name!r}; choose one of: {', '.join(REWARDS)}")
  return REWARDS[name]
