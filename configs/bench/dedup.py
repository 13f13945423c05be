"""Encoder dedup: the multimodal train step with and without encoding each unique image once.

Usage:
  python -m lab.bench --config configs/bench/dedup.py --workdir DIR
  python -m lab.bench --config configs/bench/dedup.py:balanced --workdir DIR  # LM-heavier
  python -m lab.bench --config configs/bench/dedup.py:quick --workdir DIR   # smoke

Workload: 8 unique images per mini-batch (one per group), G = 8 responses per group (64 rows),
4 micro-batches with every group's members spread over all of them. Prompt: BOS, 64 image
placeholders (32x32 RGB images, 4x4 patches), 8 text tokens; 16 response tokens.
Vision encoder: SigLIP-style ViT, 4 layers, d_model 128, 4 heads x 32, MLP 512, projector 256.
Decoder: Qwen3-style, 2 layers, d_model 128, ffn 256, 4 heads x 32, 2 KV heads, vocab 64.
AdamW, float32, 2 fake CPU devices (data parallel). Timings are medians over `repeats` steps
after one warm-up step.
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.bench = "dedup"
  c.cpu_devices = 2
  c.devices = 2  # the first N devices (0: all)
  c.mesh_shape = (-1, 1, 1)
  c.seed = 0
  c.repeats = 7
  c.workload = dict(
    unique_images=8, group_size=8, micro_batches=4, text_tokens=8, response_tokens=16
  )
  c.vision = dict(
    image_size=32,
    patch_size=4,
    channels=3,
    d_model=128,
    num_layers=4,
    num_heads=4,
    head_dim=32,
    mlp_dim=512,
    projector_dim=256,
  )
  c.model = dict(
    vocab_size=64,
    num_layers=2,
    d_model=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    ffn_dim=256,
    qk_norm=True,
  )
  c = ml_collections.ConfigDict(c)
  if arg == "quick":
    c.repeats = 1
    c.workload.unique_images = 2
    c.workload.group_size = 4
    c.workload.micro_batches = 2
    c.workload.text_tokens = 2
    c.workload.response_tokens = 2
    c.vision.image_size = 8
    c.vision.d_model = 32
    c.vision.num_layers = 1
    c.vision.mlp_dim = 64
    c.vision.head_dim = 8
    c.vision.projector_dim = 32
    c.model.d_model = 32
    c.model.num_layers = 1
    c.model.head_dim = 8
    c.model.ffn_dim = 64
  elif arg == "balanced":
    # A wider decoder and longer responses: the encoder's share of the naive step drops to about
    # a third, closer to a real VLM (e.g. a 0.6B ViT beside a 3B decoder).
    c.model.d_model = 256
    c.model.ffn_dim = 512
    c.model.num_heads = 8
    c.model.num_kv_heads = 4
    c.workload.response_tokens = 32
  elif arg not in (None, ""):
    raise ValueError(f"unknown variant {arg!r} of configs/bench/dedup.py; choose: quick, balanced.")
  return c
