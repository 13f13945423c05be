"""Tiny VLM learns to count coloured shapes in 16x16 images (answer 0-9) under GRPO, on a CPU.

Usage:
  python -m knitjax.main --config configs/count_vlm_tiny.py --workdir /tmp/count
  python -m knitjax.main --config configs/count_vlm_tiny.py:quick --workdir /tmp/q   # smoke

Policy: SigLIP-style ViT (16x16 RGB, 4x4 patches -> 16 image tokens, 2 layers, d_model 64) + MLP
projector + Qwen3-style decoder (2 layers, d_model 64), all from random init. Task: count_images
(knitjax/tasks/count_images.py); reward 1 for the right digit then the end token (any constant
answer scores 0.10). 32 prompts x G=8 per step, one mini-batch split into 2 micro-batches; each
mini-batch encodes its 32 unique images once (vlm.encoder_dedup), not 256 times.
"""

import ml_collections

from configs import common


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = common.tiny_decoder(vocab_size=23)
  c.vision = dict(
    image_size=16,
    patch_size=4,
    channels=3,
    d_model=64,
    num_layers=2,
    num_heads=4,
    head_dim=16,
    mlp_dim=128,
    projector_dim=128,
  )
  c.task = dict(name="count_images", reward="count_exact")
  c.rollout = dict(group_size=8, max_new_tokens=2, temperature=1.0)
  c.update(common.grpo())
  c.layout.micro_batches = 2
  c.vlm = dict(encoder_dedup=True, remat_encoder=False)
  c.admission = dict(policy="minibatch", quotas={"count": 32}, minibatches=1)
  c.topology = dict(mode="colocated")
  c.loop = dict(steps=600, log_every=25)
  c.mesh = dict(shape=(-1, 1, 1), cpu_devices=2)
  c.checkpoint = dict(every_steps=200, keep=1)
  if arg == "quick":
    c.loop.steps = 2
    c.loop.log_every = 1
    c.checkpoint.every_steps = 1
  elif arg not in (None, ""):
    raise ValueError(f"unknown variant {arg!r} of configs/count_vlm_tiny.py; choose: quick.")
  return common.complete(c)
