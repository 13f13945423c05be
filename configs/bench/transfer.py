"""Trajectory transfer: on-demand access vs central gather-and-scatter vs hash placement.

Usage:
  python -m lab.bench --config configs/bench/transfer.py --workdir DIR
  python -m lab.bench --config configs/bench/transfer.py:quick --workdir DIR   # smoke

Workload: 4 trainer hosts (consumers), one storage unit each; 8 mini-batches of 32 groups x
G = 16 samples, 512-token prompts, responses of 512-2048 tokens (uniform), written to the unit of
a random host (the host whose rollout worker generated the group). Part 2 runs
configs/arith_disagg.py:quick for `real.steps` steps with pipeline.prefetch 0 and 1.
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.bench = "transfer"
  c.cpu_devices = 8  # part 2's disaggregated runs use 4 + 4 fake devices
  c.seed = 0
  c.workload = dict(
    hosts=4,
    minibatches=8,
    groups_per_minibatch=32,
    group_size=16,
    prompt_len=512,
    response_len=2048,
    vocab_size=32_000,
    locality_slack=0.5,
  )
  c.real = dict(enabled=True, steps=12, skip_steps=2)
  if arg == "quick":
    c.workload.minibatches = 2
    c.workload.groups_per_minibatch = 8
    c.workload.group_size = 4
    c.workload.prompt_len = 16
    c.workload.response_len = 32
    c.real.enabled = False
  elif arg not in (None, ""):
    raise ValueError(f"unknown variant {arg!r} of configs/bench/transfer.py; choose: quick.")
  return c
