"""Scaling the Ray rollout workers of a running disaggregated run: 1 -> 3 -> 1.

    python -m lab.bench --config configs/bench/elastic.py --workdir runs/bench_elastic
    python -m lab.bench --config configs/bench/elastic.py:quick --workdir /tmp/bench_elastic

`configs/arith_disagg.py:quick`'s run (two classes, quotas per mini-batch, depth
``max_lag_steps=1``) with its rollout in one Ray actor; after ``up_after`` train steps the bench
asks for ``workers`` actors (`knitjax.distributed.elastic.request`, what ``python -m
knitjax.scale`` writes), and once every new actor is working and ``hold_s`` seconds have passed,
for one again. The run has ``steps`` train steps in all; the local Ray offers ``workers`` CPUs.
"""

import ml_collections as mc

from configs import arith_disagg


def get_config(arg: str | None = None) -> mc.ConfigDict:
  c = mc.ConfigDict()
  c.bench = "elastic"
  c.cpu_devices = 2  # the trainer's devices; each rollout actor sees as many
  t = c.train = arith_disagg.get_config("quick")
  t.topology.rollout_workers = 1
  t.checkpoint.every_steps = 1000  # none in the run: it measures scaling, not saving
  t.loop.log_every = 1
  c.workers = 3
  c.up_after = 20  # train steps with one worker before the request for ``workers``
  c.hold_s = 30.0  # seconds with every new worker working before the request for one
  c.after_steps = 100  # train steps at least after the request for one
  t.loop.steps = 600
  if arg in (None, ""):
    return c
  if arg == "quick":
    c.up_after, c.hold_s, c.after_steps = 6, 4.0, 30
    t.loop.steps = 150
    return c
  raise ValueError(f"elastic config arg={arg!r} is not accepted; use '' or 'quick'.")
