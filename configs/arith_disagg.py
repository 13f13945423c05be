"""Disaggregated GRPO on the two-class long-tail task: rollout and trainer run at the same time.

Usage:
  python -m knitjax.main --config configs/arith_disagg.py --workdir /tmp/disagg
  python -m knitjax.main --config configs/arith_disagg.py:quick --workdir /tmp/dq   # smoke
  python -m knitjax.main --config configs/arith_disagg.py:colocated --workdir /tmp/dc  # reference

8 fake CPU devices: the first 4 run the rollout (continuous batching, 128 sample slots), the
other 4 train. Task `knitjax.tasks.longtail`: class ``arith`` (short answers, budget 4 tokens)
and class ``think`` (free "thinking" before the answer, budget 16 tokens: the long tail), 16
groups of each per train step, G=8, M=4 mini-batches with at least 2 groups of each class.
Weights are published after every mini-batch; rollout may run one train step ahead
(``max_lag_steps=1``). Learning settings are those of configs/common.py (lr 1e-3, entropy bonus).
"""

import ml_collections

from configs import common


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = common.tiny_decoder(vocab_size=16)
  c.task = dict(name="longtail", reward="longtail")
  c.rollout = dict(
    group_size=8,
    max_new_tokens=16,
    class_max_new_tokens={"arith": 4, "think": 16},
    temperature=1.0,
    slots=128,
    decode_steps=8,
    refill_groups=8,
  )
  c.update(common.grpo())
  c.admission = dict(
    policy="minibatch",
    quotas={"arith": 16, "think": 16},
    minibatches=4,
    min_per_minibatch={"arith": 2, "think": 2},
  )
  c.topology = dict(mode="disaggregated", rollout_devices=4)
  c.loop = dict(steps=300, log_every=25)
  c.sync = dict(every="minibatch", adoption="new_groups", held_versions=2)
  c.pipeline = dict(
    max_lag_steps=1.0,
    prefetch=1,  # on-demand access: the next mini-batch is fetched while this one trains
    locality_slack=0.5,
  )
  c.mesh = dict(shape=(-1, 1, 1), cpu_devices=8)
  c.checkpoint = dict(every_steps=50, keep=2)
  if arg in (None, ""):
    return common.complete(c)
  if arg == "quick":
    c.admission.quotas = {"arith": 4, "think": 4}
    c.admission.minibatches = 2
    c.admission.min_per_minibatch = {"arith": 1, "think": 1}
    c.rollout.group_size = 4
    c.rollout.slots = 32
    c.loop.steps = 3
    c.loop.log_every = 1
    c.checkpoint.every_steps = 1
    return common.complete(c)
  if arg == "colocated":
    c.topology.mode = "colocated"
    return common.complete(c)
  raise ValueError(f"unknown variant {arg!r} of configs/arith_disagg.py; choose: quick, colocated.")
