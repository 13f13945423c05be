"""The real-size path (issue 35): SmolLM2-135M-Instruct's generation vs transformers', train pass.

Usage: python -m lab.bench --config configs/bench/real_model.py --workdir DIR        # CPU
       python -m lab.bench --config configs/bench/real_model.py:gpu --workdir DIR    # one H100
       python -m lab.bench --config configs/bench/real_model.py:quick --workdir DIR  # tests

Default (the CPU sizes of docs/real_model.md): 32 chat prompts x 128 greedy tokens in float32,
knitjax's sampler and transformers' ``generate`` in alternating rounds; the train pass on 32 rows
x 256 tokens (64 prompt) in 4 micro-batches with AdamW, float32, beside a 2048^3 float32 matmul;
3 rounds of each. ``:gpu`` (one H100, lab/scripts/device/smollm2_learn.sh): 128 prompts x 256
tokens, generation still in float32 (tokens comparable with transformers'), the train pass in
bfloat16 compute on 64 rows x 1024 tokens beside an 8192^3 bfloat16 matmul, MFU against the H100
SXM's 989 TFLOP/s dense bf16. ``:quick``: 2 prompts x 4 tokens, 2 rows x 32 tokens, 1 round,
still the real weights.
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.bench = "real_model"
  c.init_from = "gguf:smollm2-135m-instruct"
  c.rounds = 3
  c.generation = dict(prompts=32, new_tokens=128, dtype="float32")
  c.train = dict(rows=32, seq_len=256, prompt_len=64, micro_batches=4, warmup=0, dtype="float32")
  c.ceiling = dict(size=2048, calls=5)  # a jitted square matmul in the train dtype
  c.peak_tflops = 0.0  # per device; 0: no MFU (the CPU), FLOP/s against the ceiling only
  if arg == "gpu":
    c.generation.update(prompts=128, new_tokens=256)
    c.train.update(rows=64, seq_len=1024, prompt_len=256, micro_batches=4, dtype="bfloat16")
    c.ceiling = dict(size=8192, calls=10)
    c.peak_tflops = 989.0  # H100 SXM, dense bf16
  elif arg == "quick":
    c.rounds = 1
    c.generation.update(prompts=2, new_tokens=4)
    c.train.update(rows=2, seq_len=32, prompt_len=16, micro_batches=2)
    c.ceiling = dict(size=256, calls=2)
  elif arg not in (None, ""):
    raise ValueError(f"unknown variant {arg!r} of configs/bench/real_model.py; choose: gpu, quick.")
  return c
