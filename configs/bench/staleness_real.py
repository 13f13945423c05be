"""Real staleness benchmark: measured frontier of real runs, the simulator's prediction, learning.

    python -m lab.bench --config configs/bench/staleness_real.py --workdir /tmp/st_real
    python -m lab.bench --config configs/bench/staleness_real.py:quick --workdir /tmp/st_rq

Runs (each a ``python -m knitjax.main`` process; the commands are in the JSON):
* frontier: colocated, and disaggregated ``train_batch`` / ``minibatch`` at depths
  ``max_lag_steps`` 0, 1/M and 1, ``frontier_steps`` train steps each, measured after
  ``warmup_steps``, with a tiny learning rate (stationary long-tail lengths);
* learning: colocated (``learning_steps``) and both disaggregated policies at ``learning_depth``
  (1.1x as many steps), with the training config's learning rate, for each of
  ``learning_seeds``.

The training config is `configs/arith_disagg.py` (two quota classes, long-tail ``think``
answers); override any of it with ``--config.train.<section>.<field>=...``.
"""

import ml_collections as mc

from configs import arith_disagg


def get_config(arg: str | None = None) -> mc.ConfigDict:
  """``arg``: None (full), ``paper`` (the paper's regime) or ``quick`` (tiny, in process)."""
  c = mc.ConfigDict()
  c.bench = "staleness_real"
  c.train = arith_disagg.get_config()
  # One core per side on a 2-core machine: 2 fake devices, 1 rollout + 1 train (8 fake devices
  # on 2 cores only add overhead; colocated runs use both devices for each phase).
  c.train.mesh.cpu_devices = 2
  c.train.topology.rollout_devices = 1
  c.adoption = (
    "mid_generation"  # partial rollout: what the simulator models for a fixed-slot engine
  )
  # The full 1/M grid: {0, 1/M, 1} cannot resolve the cut (interpolating across [1/M, 1] on a
  # saturating frontier is biased toward 0).
  c.depths = (0.0, 0.25, 0.5, 0.75, 1.0)
  c.reference_depth = 1.0
  c.frontier_steps = 40
  c.warmup_steps = 8
  c.frontier_lr = 1e-7
  c.repeats = 2  # runs per frontier point, in alternating order; points are their means
  c.learning_steps = 400  # 0: learning curves from the first frontier runs instead
  c.learning_depth = 0.25  # max_lag_steps of the two disaggregated learning runs
  c.learning_seeds = (0, 1, 2)  # each: colocated + both disaggregated policies, same data
  c.learning_window = 20
  c.learning_factor = 1.1
  c.sim_seeds = 3
  c.tolerance = 0.2
  c.in_process = False
  # > 0: every run in an emulated cluster (lab/cluster, needs root and iproute2) joined as one
  # Ray cluster, links shaped at this rate: the trainer on a host of one core (the Ray head), a
  # disaggregated run's rollout in one Ray rollout actor (topology.rollout_workers=1) and its
  # storage unit on the Ray node of a host of the other core, a colocated run on a host of both.
  c.cluster_link_mbit = 0.0
  # Reuse finished runs of the same config already in the workdir (judge recorded runs again,
  # e.g. after a calibration change) instead of running them again.
  c.reuse_runs = False
  if arg in (None, ""):
    return c
  if arg == "quick":
    c.train = arith_disagg.get_config("quick")
    c.depths = (0.0, 1.0)
    c.frontier_steps = 5
    c.warmup_steps = 1
    c.repeats = 1
    c.learning_steps = 0
    c.learning_depth = 1.0
    c.learning_window = 2
    c.sim_seeds = 1
    c.in_process = True
    return c
  if arg == "paper":
    # The paper's regime at CPU size: 32 groups x G=8 = 256 samples a step through 32 slots
    # (8 rollout waves per step), M = 16 mini-batches of 2 groups (one of each class: quotas
    # feasible at M = 16), chunked prefill with one prefill per group, the full 1/16 depth grid.
    t = c.train
    t.admission.minibatches = 16
    t.admission.min_per_minibatch = {"arith": 1, "think": 1}
    t.rollout.slots = 32
    t.rollout.refill_groups = 2
    c.depths = tuple(k / 16 for k in range(17))
    c.repeats = 1
    c.frontier_steps = 24
    c.warmup_steps = 4
    c.learning_depth = 1 / 16
    c.learning_steps = 200
    return c
  raise ValueError(
    f"staleness_real config arg={arg!r} is not accepted; use '', 'paper' or 'quick'."
  )
