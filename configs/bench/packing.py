"""Train-step useful tokens/s, packed rows vs padded rows (same rows, one run).

Usage: python -m lab.bench --config configs/bench/packing.py --workdir DIR
       python -m lab.bench --config configs/bench/packing.py:quick --workdir DIR

Workload: 64 rows, prompts of 16..64 tokens (P = 64), responses lognormal with median 48 tokens
and log-sd 1.0, clipped to [1, 512] (N = 512): a long tail, ~6% of the rows at the budget's upper
half. Padded rows are 576 tokens; packed sequences are pack_len = 576 (0: P + N). The model is a
4-layer d_model 128 decoder (vocab 256), AdamW, 2 micro-batches, one CPU device. ``:quick`` is a
tiny decoder on 16 short rows, for tests.
"""

import ml_collections

from configs import common


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.bench = "packing"
  c.cpu_devices = 1
  c.devices = 1
  c.mesh_shape = (1, 1, 1)
  c.model = common.tiny_decoder(
    vocab_size=256, num_layers=4, d_model=128, num_heads=4, head_dim=32, ffn_dim=256
  )
  c.seed = 0
  c.rows = 64
  c.prompt_min = 16
  c.prompt_len = 64
  c.max_new_tokens = 512
  c.response_median = 48.0
  c.response_sigma = 1.0
  c.pack_len = 0
  c.pack_buckets = 1
  c.micro_batches = 2
  c.repeats = 3
  c.optimizer = dict(lr=1e-5, warmup_steps=0, weight_decay=0.0, b1=0.9, b2=0.999, grad_clip=1.0)
  if arg == "quick":
    c.model = common.tiny_decoder(vocab_size=16)
    c.rows, c.prompt_min, c.prompt_len, c.max_new_tokens = 16, 2, 4, 24
    c.response_median, c.repeats = 4.0, 1
  elif arg not in (None, ""):
    raise ValueError(f"unknown variant {arg!r} of configs/bench/packing.py; choose: quick.")
  return c
