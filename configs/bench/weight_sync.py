"""Weight publish time per version (lab/bench/weight_sync.py).

Usage: python -m lab.bench --config configs/bench/weight_sync.py --workdir DIR
       python -m lab.bench --config configs/bench/weight_sync.py:cpu --workdir DIR
       python -m lab.bench --config configs/bench/weight_sync.py:quick --workdir DIR

Shape: Qwen2.5-0.5B (24 layers, d_model 896, 14 heads x 64, 2 KV heads, ffn 4864, vocab 151936,
tied embeddings; 494M params), random. 8 devices: 4 train (FSDP (1, 4, 1) or tensor (1, 1, 4))
publishing onto 4 data-parallel rollout devices, 5 versions per variant after a warm-up.
``:cpu`` keeps every layer shape but 2 layers (166M params: the embedding is most of it), which
fits a small CPU machine's memory beside the replicated rollout copies; ``:quick`` is the tiny
2-layer d_model 64 decoder, for tests.
"""

import ml_collections

from configs import common
from configs.bench.mfu import QWEN25_05B


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.bench = "weight_sync"
  c.cpu_devices = 8
  c.train_devices = 4
  c.train_meshes = {"fsdp": (1, 4, 1), "tensor": (1, 1, 4)}
  c.variants = ("f32_plain", "f32_blocking", "bf16_blocking", "bf16_async")
  c.model = dict(QWEN25_05B)
  c.repeats = 5
  if arg == "cpu":
    c.model.num_layers = 2
    c.repeats = 3
  elif arg == "quick":
    c.model = common.tiny_decoder(vocab_size=64)
    c.repeats = 2
  elif arg not in (None, ""):
    raise ValueError(
      f"unknown variant {arg!r} of configs/bench/weight_sync.py; choose: cpu, quick."
    )
  return c
