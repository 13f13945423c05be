"""A disaggregated trainer of 2 processes vs 1, the paper's regime at CPU size (one point).

    python -m lab.bench --config configs/bench/trainer_processes.py --workdir runs/bench_processes
    python -m lab.bench --config configs/bench/trainer_processes.py:quick --workdir /tmp/bgq

Both variants train on 4 devices (FSDP) with the rollout in 2 Ray actors: ``one`` is one
trainer process of 8 fake devices (4 train; 4 stage the published weights, the one-process
route), ``two`` is 2 trainer processes of 2 devices each (one global mesh of 4; each process
sends its own shards).
The point: `configs/bench/staleness_real.py:paper`'s regime (32 groups a step, M = 16
mini-batches of one group of each class, 32 slots), admission ``minibatch`` at ``depth``, a tiny
learning rate (a stationary workload), ``steps`` train steps measured after ``warmup_steps``,
``repeats`` runs of each variant in alternating order.
"""

import ml_collections as mc

from configs import arith_disagg


def get_config(arg: str | None = None) -> mc.ConfigDict:
  c = mc.ConfigDict()
  c.bench = "trainer_processes"
  t = c.train = arith_disagg.get_config()
  t.admission.minibatches = 16
  t.admission.min_per_minibatch = {"arith": 1, "think": 1}
  t.rollout.slots = 32
  t.rollout.refill_groups = 2
  t.topology.rollout_workers = 2
  t.sync.adoption = "mid_generation"
  t.optimizer.lr = 1e-7
  c.depth = 0.25
  c.steps = 16
  c.warmup_steps = 4
  c.repeats = 2
  if arg in (None, ""):
    return c
  if arg == "quick":
    c.train = arith_disagg.get_config("quick")
    c.train.topology.rollout_workers = 2
    c.depth, c.steps, c.warmup_steps, c.repeats = 0.5, 3, 1, 1
    return c
  raise ValueError(f"trainer_processes config arg={arg!r} is not accepted; use '' or 'quick'.")
