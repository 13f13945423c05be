"""Simulator inputs: the workload (classes, cluster, costs) and the pipeline (policy, depth, sync).

Both are frozen keyword-only dataclasses that validate themselves. ``Workload`` is what the
cluster and the data are; ``Pipeline`` is how the system is run on it (the knobs a benchmark
sweeps). Every cost-model assumption is spelled out in docs/simulator.md.
"""

import dataclasses
import math

from knitjax.config_run import MODES
from knitjax.config_run import SYNC_EVERY as WEIGHT_SYNC
from knitjax.rollout.contract import ADOPTION
from knitjax.rollout.versions import LAG_UNITS
from knitjax.sim.scheduling import SCHEDULING
from knitjax.transfer.admission import POLICIES
from knitjax.transfer.quota import QuotaSpec


def _check(ok: bool, message: str) -> None:
  if not ok:
    raise ValueError(message)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClassSpec:
  """One quota class: its share of a train step, its lengths and its rejection rate.

  Attributes:
    name: class name (e.g. ``"math"``).
    quota: groups of this class per train step.
    min_per_minibatch: at least this many groups of the class in every mini-batch.
    max_per_minibatch: at most this many (0: no bound).
    length_mean: mean response length (tokens) of the lognormal, before the cap.
    length_cv: coefficient of variation (std / mean) of the lognormal; 0 is a constant length.
    length_max: generation cap: lengths are clipped to it (max new tokens).
    length_trace: optional text file of lengths, one a line; when set it replaces the lognormal.
    prompt_tokens: prompt length of every sample of the class (prefill and trainer tokens).
    reject_prob: probability that dynamic sampling rejects a complete group (all rewards equal).
  """

  name: str
  quota: int
  min_per_minibatch: int = 0
  max_per_minibatch: int = 0
  length_mean: float = 1000.0
  length_cv: float = 1.0
  length_max: int = 16384
  length_trace: str = ""
  prompt_tokens: int = 256
  reject_prob: float = 0.0

  def __post_init__(self):
    _check(bool(self.name), "ClassSpec.name must be a non-empty class name.")
    n = self.name
    _check(self.quota >= 1, f"ClassSpec({n}).quota={self.quota!r} must be an int >= 1.")
    _check(self.min_per_minibatch >= 0, f"ClassSpec({n}).min_per_minibatch must be >= 0.")
    _check(self.max_per_minibatch >= 0, f"ClassSpec({n}).max_per_minibatch must be >= 0.")
    _check(self.length_mean > 0, f"ClassSpec({n}).length_mean={self.length_mean!r} must be > 0.")
    _check(self.length_cv >= 0, f"ClassSpec({n}).length_cv={self.length_cv!r} must be >= 0.")
    _check(self.length_max >= 1, f"ClassSpec({n}).length_max={self.length_max!r} must be >= 1.")
    _check(
      self.prompt_tokens >= 0, f"ClassSpec({n}).prompt_tokens={self.prompt_tokens!r} must be >= 0."
    )
    _check(
      0 <= self.reject_prob < 1,
      f"ClassSpec({n}).reject_prob={self.reject_prob!r} must be in [0, 1).",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """The data and the cluster: classes, group size, slots and the cost model.

  Attributes:
    classes: the quota classes, in class order.
    group_size: `G`, samples per group (submitted together).
    minibatches: `M`, mini-batches per train step.
    slots: `S`, concurrent sample slots of the whole rollout fleet (continuous batching).
    decode_s_per_token: seconds per decode iteration at low occupancy; every active sample
      gains one token per iteration.
    occupancy_slowdown: iteration time is ``decode_s_per_token * (1 + occupancy_slowdown *
      active / slots)``; 0 means occupancy does not slow decoding.
    prefill_s_per_token: prefill seconds per prompt token, spent in the sample's own slot.
    group_start_pause_s: seconds every group start stalls the whole pool (an engine whose
      prefill, or host work per start, interrupts decoding of all slots); 0: starts never stall.
    weight_sync_s: seconds rollout decoding pauses to load each published version.
    trainer_s_per_token: trainer seconds per (prompt + response) token of a mini-batch.
    trainer_overhead_s: fixed trainer seconds per mini-batch (optimizer update, launch).
    trainer_step_overhead_s: trainer seconds of host work once per train step, after its last
      mini-batch's weights are published (metrics, logging); the next mini-batch waits for it.
    report_delay_s: seconds from a group's last sample ending to its offer to admission (an
      engine that hands finished samples back only when its call returns to the host); 0: at once.
    trainer_contended_s: extra trainer seconds for a mini-batch that starts while rollout has
      groups generating (trainer and rollout sharing the same cores, as on one CPU host); 0: the
      trainer's speed does not depend on rollout.
  """

  classes: tuple[ClassSpec, ...]
  group_size: int = 16
  minibatches: int = 4
  slots: int = 512
  decode_s_per_token: float = 0.03
  occupancy_slowdown: float = 0.0
  prefill_s_per_token: float = 1e-4
  group_start_pause_s: float = 0.0
  weight_sync_s: float = 2.0
  trainer_s_per_token: float = 1e-5
  trainer_overhead_s: float = 1.0
  trainer_step_overhead_s: float = 0.0
  report_delay_s: float = 0.0
  trainer_contended_s: float = 0.0

  def __post_init__(self):
    object.__setattr__(self, "classes", tuple(self.classes))
    _check(len(self.classes) >= 1, "Workload.classes is empty; give at least one ClassSpec.")
    names = [c.name for c in self.classes]
    _check(len(set(names)) == len(names), f"Workload.classes has repeated names {names}.")
    _check(self.group_size >= 1, f"Workload.group_size={self.group_size!r} must be >= 1.")
    _check(
      self.slots >= self.group_size,
      f"Workload.slots={self.slots!r} must be >= group_size={self.group_size} (a group starts "
      "with all its samples).",
    )
    for name in ("decode_s_per_token",):
      _check(getattr(self, name) > 0, f"Workload.{name}={getattr(self, name)!r} must be > 0.")
    for name in (
      "occupancy_slowdown",
      "prefill_s_per_token",
      "group_start_pause_s",
      "weight_sync_s",
      "trainer_s_per_token",
      "trainer_overhead_s",
      "trainer_step_overhead_s",
      "report_delay_s",
      "trainer_contended_s",
    ):
      v = getattr(self, name)
      _check(math.isfinite(v) and v >= 0, f"Workload.{name}={v!r} must be finite and >= 0.")
    self.quota_spec()  # raises ValueError naming the conflict when no step can satisfy it

  def quota_spec(self) -> QuotaSpec:
    """The admission index's view of the classes."""
    return QuotaSpec(
      {c.name: c.quota for c in self.classes},
      self.minibatches,
      min_per_minibatch={c.name: c.min_per_minibatch for c in self.classes if c.min_per_minibatch},
      max_per_minibatch={c.name: c.max_per_minibatch for c in self.classes if c.max_per_minibatch},
    )

  @property
  def groups_per_step(self) -> int:
    """`B`: groups consumed per train step."""
    return sum(c.quota for c in self.classes)

  @property
  def groups_per_minibatch(self) -> int:
    """`B/M`."""
    return self.groups_per_step // self.minibatches


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pipeline:
  """How the system runs on a workload: the knobs the staleness benchmark sweeps.

  Attributes:
    policy: admission policy of the index (`train_batch`, `minibatch`, `greedy`).
    mode: `disaggregated` (rollout and trainer run concurrently) or `colocated` (they take turns;
      the reference for architectural staleness; depth is 0 and the trainer waits for the rollout
      to drain).
    max_lag_steps: pipeline depth: accepted groups started so far may not exceed
      ``B * (completed_steps + 1 + max_lag_steps)``; a multiple of 1/M.
    lag_unit: `step` (capacity comes back once a step's last mini-batch is consumed) or
      `minibatch` (per consumed mini-batch; `knitjax.rollout.versions.start_limit`).
    max_inflight_groups: at most this many groups generating at once (0: only slots bound it).
    weight_sync: publish weights after every `minibatch` or every `step`.
    adoption: `new_groups` (a group keeps the weights it started with) or `mid_generation`
      (partial rollout: in-flight groups switch at each sync; gen version stays the oldest).
    scheduling: which class the next prompt comes from: `plain` (quota proportion) or
      `admission_aware` (the classes the open steps still need, throttled by what is needed).
  """

  policy: str = "minibatch"
  mode: str = "disaggregated"
  max_lag_steps: float = 1.0
  lag_unit: str = "step"
  max_inflight_groups: int = 0
  weight_sync: str = "minibatch"
  adoption: str = "new_groups"
  scheduling: str = "plain"

  def __post_init__(self):
    for name, allowed in (
      ("policy", POLICIES),
      ("mode", MODES),
      ("weight_sync", WEIGHT_SYNC),
      ("adoption", ADOPTION),
      ("scheduling", SCHEDULING),
      ("lag_unit", LAG_UNITS),
    ):
      v = getattr(self, name)
      _check(v in allowed, f"Pipeline.{name}={v!r} is not accepted; choose one of {allowed}.")
    _check(
      math.isfinite(self.max_lag_steps) and self.max_lag_steps >= 0,
      f"Pipeline.max_lag_steps={self.max_lag_steps!r} must be finite and >= 0.",
    )
    _check(
      self.max_inflight_groups >= 0,
      f"Pipeline.max_inflight_groups={self.max_inflight_groups!r} must be >= 0 (0: no limit).",
    )

  def lag_groups(self, workload: Workload) -> int:
    """Depth in groups, ``max_lag_steps * B``; raises unless it is whole mini-batches."""
    mb = workload.groups_per_minibatch
    units = self.max_lag_steps * workload.minibatches
    _check(
      abs(units - round(units)) < 1e-6,
      f"Pipeline.max_lag_steps={self.max_lag_steps!r} must be a multiple of 1/M = "
      f"1/{workload.minibatches}.",
    )
    return round(units) * mb
