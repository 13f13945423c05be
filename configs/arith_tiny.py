"""Tiny GRPO run that learns ``(a + b) mod 10`` from random init by RL alone, on a CPU.

Usage:
  python -m knitjax.main --config configs/arith_tiny.py --workdir /tmp/arith
  python -m knitjax.main --config configs/arith_tiny.py:quick --workdir /tmp/q   # 2 steps, smoke
  python -m knitjax.main --config configs/arith_tiny.py:lora --workdir /tmp/lora  # LoRA r=16
Settings (configs/common.py): 32 prompts x G=8 per step, lr 1e-3, entropy bonus 0.01,
PPO-clip 0.2, token-mean, no KL; the reward requires the answer digit then the end token.
"""

import ml_collections

from configs import common

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = common.tiny_decoder(vocab_size=16)
  c.task = dict(name="arith", reward="arith_exact")
  c.rollout = dict(group_size=8, max_new_tokens=4, temperature=1.0)
  c.train = common.grpo_train()
  c.admission = dict(policy="minibatch", quotas={"arith": 32}, minibatches=1)
  c.runtime = dict(mode="colocated", steps=600, log_every=25, prefetch=1)
  c.mesh = dict(shape=(-1, 1, 1), cpu_devices=2)
  c.checkpoint = dict(every_steps=100, keep=2)
  variants = (arg or "").split(",")
  if "lora" in variants:
    # LoRA adapters (rank 16, every projection) train; the base (this seed's init, or
    # --config.init_from=DIR) stays frozen. docs/algorithms.md, "LoRA".
    c.model.update(lora_rank=16, lora_alpha=32.0, lora_targets=list(LORA_TARGETS))
    c.model.lora_base_dtype = "float32"
    c.train.lr = 3e-3
  if "quick" in variants:
    c.runtime.steps = 2
    c.runtime.log_every = 1
    c.checkpoint.every_steps = 1
  if unknown := [v for v in variants if v not in ("", "lora", "quick")]:
    raise ValueError(
      f"unknown variant {unknown[0]!r} of configs/arith_tiny.py; choose: quick, lora, lora,quick."
    )
  return common.complete(c)
