"""Log-prob + entropy memory, whole logits vs chunked, from XLA's compiled memory analysis.

Usage: python -m lab.bench --config configs/bench/logprob_memory.py --workdir DIR
       python -m lab.bench --config configs/bench/logprob_memory.py:quick --workdir DIR

Shape: Qwen2.5-0.5B's output layer (vocab 151936, d_model 896, tied), one row of T = 2048 and
4096 positions, bfloat16 hidden states and a float32 table; chunks of 128 positions (the
default, config.layout.logprob_chunk), a larger 512 and a smaller 32. Traced only (nothing is
allocated). ``:quick`` is a vocab-512 d_model-32 shape, for tests.
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.bench = "logprob_memory"
  c.cpu_devices = 1
  c.vocab = 151936
  c.d_model = 896
  c.rows = 1
  c.seq_lens = (2048, 4096)
  c.chunks = (512, 128, 32)
  c.dtype = "bfloat16"
  if arg == "quick":
    c.vocab, c.d_model, c.seq_lens, c.chunks = 512, 32, (64,), (16,)
  elif arg not in (None, ""):
    raise ValueError(f"unknown variant {arg!r} of configs/bench/logprob_memory.py; choose: quick.")
  return c
