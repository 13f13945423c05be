"""Train-step memory and compile time: layer loop vs scan, remat none / block / dots.

Usage: python -m lab.bench --config configs/bench/layer_memory.py --workdir DIR
       python -m lab.bench --config configs/bench/layer_memory.py:quick --workdir DIR

Shape: Qwen2.5-0.5B's decoder (24 layers, d_model 896, 14 heads x 64, 2 KV heads, ffn 4864,
q/k/v bias) in bf16 with its vocabulary cut to 8192 (the logits are the log-prob benchmark's
subject, not this one's); 8 rows x 1024 tokens in 2 micro-batches, traced and compiled only, on
one device. ``:quick``: a 4-layer d_model 64 decoder, for tests.
"""

import ml_collections

from configs.bench.mfu import QWEN25_05B


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.bench = "layer_memory"
  c.cpu_devices = 1
  c.devices = 1
  c.mesh_shape = (1, 1, 1)
  c.model = dict(QWEN25_05B, vocab_size=8192, remat="none", scan_layers=False)
  c.remats = ("none", "block", "dots")
  c.rows, c.seq_len, c.micro_batches = 8, 1024, 2
  if arg == "quick":
    c.model.update(num_layers=4, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16,
                   ffn_dim=128, vocab_size=64, dtype="float32")  # fmt: skip
    c.remats = ("none", "block")
    c.rows, c.seq_len = 4, 64
  elif arg not in (None, ""):
    raise ValueError(f"unknown variant {arg!r} of configs/bench/layer_memory.py; choose: quick.")
  return c
