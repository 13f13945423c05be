"""Tiny GRPO run that learns ``(a + b) mod 10`` from random init by RL alone, on a CPU.

Usage:
  python -m knitjax.main --config configs/arith_tiny.py --workdir /tmp/arith
  python -m knitjax.main --config configs/arith_tiny.py:quick --workdir /tmp/q   # 2 steps, smoke
  python -m knitjax.main --config configs/arith_tiny.py:ppo --workdir /tmp/ppo  # PPO, critic+GAE
  python -m knitjax.main --config configs/arith_tiny.py:kl_reward --workdir /tmp/klr
  python -m knitjax.main --config configs/arith_tiny.py:lora --workdir /tmp/lora  # LoRA r=16
Variants are comma-separated flags: quick, ppo (advantage "gae", a value head), kl_reward (the
KL to the initial policy as a reward penalty), lora (adapters only, the base frozen), share (each
group's prompt laid out once before its responses: layout.prompt_sharing="group"), prefix (each
group's prompt run once per mini-batch, its 8 responses' rows over 4 micro-batches:
layout.prompt_sharing="prefix"), e.g. ``:ppo,kl_reward,quick`` or ``:lora,quick``.
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
  c.update(common.grpo())
  c.admission = dict(policy="minibatch", quotas={"arith": 32}, minibatches=1)
  c.topology = dict(mode="colocated")
  c.loop = dict(steps=600, log_every=25)
  c.pipeline = dict(prefetch=1)
  c.mesh = dict(shape=(-1, 1, 1), cpu_devices=2)
  c.checkpoint = dict(every_steps=100, keep=2)
  flags = set(filter(None, (arg or "").split(",")))
  if unknown := flags - set(VARIANTS):
    raise ValueError(
      f"unknown variant {sorted(unknown)} of configs/arith_tiny.py; choose from: "
      f"{', '.join(VARIANTS)} (comma-separated)."
    )
  if "ppo" in flags:
    c.loss.update(advantage="gae", whiten_advantages=True)
    c.critic = dict(PPO)
  if "kl_reward" in flags:
    # k1 (log pi - log pi_ref) is the per-token reward whose policy gradient is that of the KL;
    # k3 as a reward penalises every sampled token, most those pi samples less than pi_ref.
    c.loss.update(kl_coef=0.02, kl_penalty="reward", kl_estimator="k1")
  if "lora" in flags:
    # LoRA adapters (rank 16, every projection) train; the base (this seed's init, or
    # --config.init_from=DIR) stays frozen. docs/algorithms.md, "LoRA".
    c.model.update(lora_rank=16, lora_alpha=32.0, lora_targets=list(LORA_TARGETS))
    c.model.lora_base_dtype = "float32"
    c.optimizer.lr = 3e-3
  if "share" in flags:
    c.layout.prompt_sharing = "group"
  if "prefix" in flags:
    c.layout.update(prompt_sharing="prefix", micro_batches=4)
  if "quick" in flags:
    c.loop.steps = 2
    c.loop.log_every = 1
    c.checkpoint.every_steps = 1
  return common.complete(c)


VARIANTS = ("quick", "ppo", "kl_reward", "lora", "share", "prefix")
# PPO with a critic (docs/algorithms.md): gamma = lambda = 1, whitened advantages.
PPO = dict(gamma=1.0, gae_lambda=1.0, value_coef=0.1, value_clip=0.2)
