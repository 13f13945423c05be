"""Admission benchmark: microseconds per `AdmissionIndex.offer`, per policy.

Workload (default): 64 classes, 16 mini-batches of 32 groups (512 groups per step), 10,000
groups. Quotas: every class gets 1 group plus a share of the other 448 proportional to a
log-normal(0, 1) weight (largest remainder), seed-fixed. Bounds, so the exact check works:
every class with quota q >= 16 (10 classes at seed 0) gets the tightest min per mini-batch,
floor(q / 16); a quarter of all classes (16) get max ceil(q / 16) + 1.
Arrivals ("steps"): each run of 512 arrivals is one step's quotas in a uniformly random
order, so supply meets demand (the exact check runs about 1.8 times per offer, rescans
included); "iid" draws classes independently in proportion to the quotas instead (backlogs
grow, and most offers just join a waiting queue).

  python -m lab.bench --config configs/bench/admission.py --workdir /tmp/adm
  python -m lab.bench --config configs/bench/admission.py:quick --workdir /tmp/adm  # smoke
"""

import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.bench = "admission"
  config.num_classes = 64
  config.minibatches = 16
  config.groups_per_minibatch = 32
  config.num_groups = 10_000
  config.min_bound_fraction = 1.0  # of the classes with quota >= minibatches
  config.max_bound_fraction = 0.25  # of all classes
  config.arrivals = "steps"  # or "iid"
  config.policies = ("minibatch", "train_batch", "greedy")
  config.repeats = 3  # offer timings are pooled over repeats (same workload)
  config.seed = 0
  config.goal_median_us = 50.0
  if arg == "quick":
    config.num_classes = 4
    config.minibatches = 2
    config.groups_per_minibatch = 4
    config.num_groups = 200
    config.repeats = 1
  elif arg:
    raise ValueError(f"configs/bench/admission.py has no variant {arg!r}; use 'quick' or none.")
  return config
