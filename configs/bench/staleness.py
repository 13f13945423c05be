"""Staleness benchmark: train_batch vs constraint-preserving admission on simulated clusters.

    python -m lab.bench --config configs/bench/staleness.py --workdir /tmp/staleness
    python -m lab.bench --config configs/bench/staleness.py:quick --workdir /tmp/st_quick
    python -m lab.bench --config configs/bench/staleness.py:sweep --workdir /tmp/st_sweep
    python -m lab.bench --config configs/bench/staleness.py:paper --workdir /tmp/st_paper

Every field is overridable, e.g. ``--config.slots=1024`` or
``--config.classes.math.length_cv=0.5``. docs/simulator.md explains each cost-model assumption;
in short:

* Reference workload (the issue's long-tail math + vision mix): G=16, 64 groups per step (math 48,
  count 16, at least 2 count per mini-batch), M=4, lognormal lengths (math mean 3000 / CV 1.0 /
  cap 16384, count mean 800 / CV 0.6 / cap 4096), 512 sample slots, weights published after every
  mini-batch, new weights for newly started groups.
* Decode: 30 ms per continuous-batching iteration (one token for every active sample),
  independent of occupancy (``occupancy_slowdown=0``: memory-bound decode at this batch size).
  Only the ratio of costs matters for staleness and relative throughput; absolute steps/hour
  scale with it.
* Prefill: 0.1 ms per prompt token in the sample's own slot (chunked prefill, other slots keep
  decoding). Prompts: math 256 tokens, count 768 (text + image tokens).
* Weight sync: rollout decoding pauses 2 s per published version.
* Trainer: ``trainer_overhead_s + trainer_s_per_token * tokens`` per mini-batch, calibrated in
  `knitjax.sim.costs.calibrate_trainer` so that trainer busy time per step equals rollout busy
  time per step (``trainer_busy_ratio=1``; 10% of it fixed per-mini-batch overhead).
* Dynamic sampling: no rejections in the reference (``reject_prob=0``); the scheduling comparison
  adds a dynamic-sampling workload where they matter.
"""

import ml_collections as mc


def _classes():
  classes = mc.ConfigDict()
  classes.math = mc.ConfigDict(
    dict(
      quota=48,
      min_per_minibatch=0,
      max_per_minibatch=0,
      length_mean=3000.0,
      length_cv=1.0,
      length_max=16384,
      length_trace="",
      prompt_tokens=256,
      reject_prob=0.0,
    )
  )
  classes.count = mc.ConfigDict(
    dict(
      quota=16,
      min_per_minibatch=2,
      max_per_minibatch=0,
      length_mean=800.0,
      length_cv=0.6,
      length_max=4096,
      length_trace="",
      prompt_tokens=768,
      reject_prob=0.0,
    )
  )
  return classes


def get_config(arg: str | None = None) -> mc.ConfigDict:
  """Reference workload; ``arg``: None (full), ``quick`` (tiny, for tests/CI), ``sweep`` or
  ``paper`` (the paper's regime: 8 rollout waves per step, M = 16, light tail; and a sweep)."""
  c = mc.ConfigDict()
  c.bench = "staleness"
  # ---- workload (knitjax.sim.workload.Workload) ----
  c.class_order = "math,count"  # ConfigDict sorts keys; this fixes the class order
  c.classes = _classes()
  c.group_size = 16
  c.minibatches = 4
  c.slots = 512
  c.decode_s_per_token = 0.03
  c.occupancy_slowdown = 0.0
  c.prefill_s_per_token = 1e-4
  c.group_start_pause_s = 0.0  # chunked prefill: a start never stalls the other slots
  c.weight_sync_s = 2.0
  # Trainer cost: calibrated from the workload unless calibrate_trainer=False.
  c.calibrate_trainer = True
  c.trainer_busy_ratio = 1.0
  c.trainer_overhead_fraction = 0.1
  c.trainer_s_per_token = 0.0
  c.trainer_overhead_s = 0.0
  c.trainer_step_overhead_s = 0.0  # per-step host work after a step's last mini-batch
  c.report_delay_s = 0.0  # a finished group reaches admission this long after its last sample
  c.trainer_contended_s = 0.0  # extra trainer seconds per mini-batch started while rollout runs
  # ---- pipeline (knitjax.sim.workload.Pipeline) ----
  c.weight_sync = "minibatch"
  c.adoption = "new_groups"
  c.scheduling = "plain"
  c.lag_unit = "step"  # depth capacity back per step, or per consumed mini-batch ("minibatch")
  c.max_inflight_groups = 0
  # ---- benchmark ----
  c.max_depth = 2.0  # frontier depths 0, 1/M, ..., max_depth (train steps)
  c.reference_depth = 1.0  # where `policies`, `reduction` and `throughput_gain` are measured
  c.num_steps = 200
  c.warmup_steps = 10
  c.seed = 0
  c.compare_scheduling = True  # also run the other scheduling (and a dynamic-sampling workload)
  c.compare_adoption = True  # also run mid-generation adoption (both staleness conventions)
  c.compare_weight_sync = True  # also run the other weight-sync period (per step)
  c.dynamic_sampling_reject = "math:0.3,count:0.1"  # rejection rates of that extra workload
  c.speed_trajectories = 1_000_000  # 0 skips the simulator speed measurement
  # Sweep: (name, ((field, value), ...)) workload variants, each with its own frontier.
  c.sweep = ()
  c.sweep_num_steps = 120
  c.sweep_warmup_steps = 8

  if arg in (None, ""):
    return c
  if arg == "quick":
    c.num_steps = 12
    c.warmup_steps = 2
    c.max_depth = 1.0
    c.speed_trajectories = 20_000
    c.dynamic_sampling_reject = "math:0.3,count:0.1"
    c.sweep = (("math_cv_0.5", (("classes.math.length_cv", 0.5),)),)
    c.sweep_num_steps = 12
    c.sweep_warmup_steps = 2
    return c
  if arg == "sweep":
    c.compare_scheduling = False
    c.compare_adoption = False
    c.compare_weight_sync = False
    c.speed_trajectories = 0
    c.num_steps = 120
    c.warmup_steps = 8
    c.sweep = (
      ("math_cv_0.25", (("classes.math.length_cv", 0.25),)),
      ("math_cv_0.5", (("classes.math.length_cv", 0.5),)),
      ("math_cv_2.0", (("classes.math.length_cv", 2.0),)),
      ("mix_56_8", (("classes.math.quota", 56), ("classes.count.quota", 8))),
      ("mix_32_32", (("classes.math.quota", 32), ("classes.count.quota", 32))),
      ("M_2", (("minibatches", 2),)),
      ("M_8", (("minibatches", 8),)),
      # Not asked for, but the physical knob behind the others: slots set how long a group
      # takes to generate relative to a train step's busy time.
      ("slots_256", (("slots", 256),)),
      ("slots_1024", (("slots", 1024),)),
      # The depth bound returning capacity per consumed mini-batch (version-granular).
      ("lag_unit_minibatch", (("lag_unit", "minibatch"),)),
    )
    return c
  if arg == "paper":
    # The paper's regime: many rollout waves per step (128 slots for a step's 64 x 16 = 1024
    # samples: 8 waves), M = 16 mini-batches, a light length tail (math CV 0.25). Quotas stay
    # feasible at M = 16: the 16 count groups of a step go one to each mini-batch.
    c.slots = 128
    c.minibatches = 16
    c.classes.math.length_cv = 0.25
    c.classes.count.min_per_minibatch = 1
    c.max_depth = 1.0
    c.num_steps = 120
    c.warmup_steps = 8
    c.compare_scheduling = False
    c.compare_adoption = False
    c.compare_weight_sync = False
    c.speed_trajectories = 0
    c.sweep = (
      # Held out (not tuned on): a heavier tail, and a different mix.
      ("heldout_math_cv_0.5", (("classes.math.length_cv", 0.5),)),
      (
        "heldout_mix_56_8",
        (
          ("classes.math.quota", 56),
          ("classes.count.quota", 8),
          ("classes.count.min_per_minibatch", 0),
        ),
      ),
      # Waves per step (1024 samples / slots) and M: where the cut grows and where it vanishes.
      ("slots_512_waves_2", (("slots", 512),)),
      ("slots_256_waves_4", (("slots", 256),)),
      ("slots_64_waves_16", (("slots", 64),)),
      ("M_4", (("minibatches", 4),)),
      ("M_8", (("minibatches", 8),)),
      ("slots_512_M_4", (("slots", 512), ("minibatches", 4))),
      ("lag_unit_minibatch", (("lag_unit", "minibatch"),)),
    )
    c.sweep_num_steps = 120
    c.sweep_warmup_steps = 8
    return c
  raise ValueError(
    f"staleness config arg={arg!r} is not accepted; use '', 'quick', 'sweep' or 'paper'."
  )
