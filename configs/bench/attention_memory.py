"""Compiled memory of one attention layer, dense vs blockwise ("xla"), forward and backward.

Usage: python -m lab.bench --config configs/bench/attention_memory.py --workdir DIR
       python -m lab.bench --config configs/bench/attention_memory.py:quick --workdir DIR

Shape: Qwen2.5-0.5B's attention (d_model 896, 14 heads x 64, 2 KV heads, q/k/v bias), batch 1,
float32, at T = 1024, 2048, 4096; one CPU device. ``:quick`` is a 2-head layer at T = 1024 and
2048 (the blockwise path's 512-blocks still split it), for tests.
"""

import ml_collections

QWEN25_05B_ATTENTION = dict(d_model=896, num_heads=14, num_kv_heads=2, head_dim=64)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.bench = "attention_memory"
  c.cpu_devices = 1
  c.shape = dict(QWEN25_05B_ATTENTION, batch=1, dtype="float32")
  c.lengths = (1024, 2048, 4096)
  c.impls = ("dense", "xla")
  if arg == "quick":
    c.shape = dict(d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, batch=1, dtype="float32")
    c.lengths = (1024, 2048)
  elif arg not in (None, ""):
    raise ValueError(
      f"unknown variant {arg!r} of configs/bench/attention_memory.py; choose: quick."
    )
  return c
