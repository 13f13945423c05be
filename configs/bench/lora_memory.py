"""Train-step memory, full fine-tuning vs LoRA, from XLA's compiled memory analysis.

Usage: python -m lab.bench --config configs/bench/lora_memory.py --workdir DIR
       python -m lab.bench --config configs/bench/lora_memory.py:quick --workdir DIR

Shape: SmolLM2-135M (Llama: 30 layers, d_model 576, 9 heads x 64, 3 KV heads, ffn 1536, vocab
49152, tied embeddings), traced only (nothing is allocated); a mini-batch of 16 sequences x 256
tokens in 2 micro-batches; AdamW; a k3 KL term (kl_coef 0.04) so the full run holds a reference
copy; LoRA rank 16 (alpha 32) on every projection. One CPU device: the figures are the whole
model's. ``:quick`` is a 2-layer d_model 64 decoder, for tests.
"""

import ml_collections

from configs import common

SMOLLM2_135M = dict(
  vocab_size=49152,
  num_layers=30,
  d_model=576,
  num_heads=9,
  num_kv_heads=3,
  head_dim=64,
  ffn_dim=1536,
  rope_theta=100000.0,
  norm_eps=1e-5,
  tie_embeddings=True,
  dtype="float32",
)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.bench = "lora_memory"
  c.cpu_devices = 1
  c.devices = 1
  c.mesh_shape = (1, 1, 1)
  c.model = dict(SMOLLM2_135M)
  c.rows = 16
  c.seq_len = 256
  c.micro_batches = 2
  c.kl_coef = 0.04
  c.lora_rank = 16
  c.lora_alpha = 32.0
  if arg == "quick":
    c.model = common.tiny_decoder(vocab_size=16)
    c.rows, c.seq_len = 4, 8
  elif arg not in (None, ""):
    raise ValueError(f"unknown variant {arg!r} of configs/bench/lora_memory.py; choose: quick.")
  return c
