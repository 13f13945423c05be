"""The optimizer: AdamW with linear warmup and global-norm gradient clipping."""

from typing import Protocol

import optax


class OptimizerHParams(Protocol):
  """What the optimizer reads; `config_train.OptimizerConfig` is one (train/ sits below config)."""

  lr: float
  warmup_steps: int  # optimizer updates; 0: no warmup
  weight_decay: float
  b1: float
  b2: float
  grad_clip: float  # global norm; 0: no clipping


def make_optimizer(hparams: OptimizerHParams) -> optax.GradientTransformation:
  """AdamW on a warmup-then-constant schedule, after global-norm clipping.

  RL fine-tuning runs are short and reward-driven, so the schedule holds the
  learning rate after warmup rather than decaying it to a horizon the run may
  never reach.
  """
  if hparams.warmup_steps:
    schedule = optax.linear_schedule(0.0, hparams.lr, hparams.warmup_steps)
  else:
    schedule = optax.constant_schedule(hparams.lr)
  parts = []
  if hparams.grad_clip:
    parts.append(optax.clip_by_global_norm(hparams.grad_clip))
  parts.append(
    optax.adamw(schedule, b1=hparams.b1, b2=hparams.b2, weight_decay=hparams.weight_decay)
  )
  return optax.chain(*parts)
