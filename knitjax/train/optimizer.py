"""The optimizer: AdamW with linear warmup and global-norm gradient clipping."""

import optax

from knitjax.config import TrainConfig


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
  """AdamW on a warmup-then-constant schedule, after global-norm clipping.

  RL fine-tuning runs are short and reward-driven, so the schedule holds the
  learning rate after warmup rather than decaying it to a horizon the run may
  never reach.
  """
  if config.warmup_steps:
    schedule = optax.linear_schedule(0.0, config.lr, config.warmup_steps)
  else:
    schedule = optax.constant_schedule(config.lr)
  parts = []
  if config.grad_clip:
    parts.append(optax.clip_by_global_norm(config.grad_clip))
  parts.append(optax.adamw(schedule, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay))
  return optax.chain(*parts)
