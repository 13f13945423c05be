"""Tiny multi-turn GRPO run that learns to call a calculator tool, from random init, on a CPU.

Usage:
  python -m knitjax.main --config configs/calc_tool_tiny.py --workdir /tmp/calc
  python -m knitjax.main --config configs/calc_tool_tiny.py:quick --workdir /tmp/q   # 2 steps
  python -m knitjax.main --config configs/calc_tool_tiny.py:disagg --workdir /tmp/cd
  python -m knitjax.main --config configs/calc_tool_tiny.py:disagg_quick --workdir /tmp/cdq

Task `knitjax.tasks.calc_tool`: ``BOS a*b`` with 2-digit operands; the model may call the
calculator (``C=`` or ``C<expr>=``), whose result the environment appends, then answers. Multi-
turn rollout (`knitjax.rollout.multiturn`): at most 3 model turns of at most 6 tokens, 16
response tokens in all (model and environment tokens). 32 prompts x G=8 per step; learning
settings of configs/common.py (lr 1e-3, entropy bonus 0.01). Metrics to watch: ``reward_mean``,
``env_token_rows`` (the fraction of samples that called the tool) and ``solved_fraction``.
"""

import ml_collections

from configs import common

VARIANTS = ("quick", "disagg", "disagg_quick")


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = common.tiny_decoder(vocab_size=18)
  c.task = dict(name="calc_tool", reward="calc_answer")
  c.rollout = dict(
    group_size=8, max_new_tokens=16, turn_tokens=6, max_turns=3, temperature=1.0, slots=64
  )
  c.update(common.grpo())
  c.admission = dict(policy="minibatch", quotas={"calc": 32}, minibatches=1)
  c.topology = dict(mode="colocated")
  c.loop = dict(steps=600, log_every=25)
  c.pipeline = dict(prefetch=1)
  c.mesh = dict(shape=(-1, 1, 1), cpu_devices=2)
  c.checkpoint = dict(every_steps=100, keep=2)
  if arg in ("disagg", "disagg_quick"):
    # 4 fake devices: 2 sample, 2 train; up to slots / G = 16 live groups; M = 2 mini-batches.
    c.topology.update(mode="disaggregated", rollout_devices=2)
    c.pipeline.max_lag_steps = 1.0
    c.loop.steps = 200
    c.rollout.slots = 128
    c.admission.minibatches = 2
    c.mesh.cpu_devices = 4
  if arg in ("quick", "disagg_quick"):
    c.admission.quotas = {"calc": 4}
    c.loop.steps = 2
    c.loop.log_every = 1
    c.checkpoint.every_steps = 1
  elif arg not in (None, "", "disagg"):
    raise ValueError(
      f"unknown variant {arg!r} of configs/calc_tool_tiny.py; choose: {', '.join(VARIANTS)}."
    )
  return common.complete(c)
