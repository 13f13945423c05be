"""Expected busy time per train step, and the trainer calibration derived from it.

"Busy time" is the time a side would need per train step if it never waited: the rollout at full
slot occupancy, the trainer back to back. The reference workload sets the trainer cost so the two
are equal, the regime where pipelining matters most (neither side can hide the other).
"""

import dataclasses

import numpy as np

from knitjax.sim.lengths import clipped_lognormal_mean, load_trace
from knitjax.sim.workload import ClassSpec, Workload


def mean_length(spec: ClassSpec) -> float:
  """Expected response length of a class (after the generation cap)."""
  if spec.length_trace:
    return float(np.mean(load_trace(spec.length_trace)))
  return clipped_lognormal_mean(spec.length_mean, spec.length_cv, spec.length_max)


def rollout_busy_per_step(w: Workload) -> float:
  """Seconds of rollout per train step at full occupancy.

  Counts the groups dynamic sampling rejects (``quota / (1 - reject_prob)`` generated per
  accepted quota), prefill in each sample's slot, and group starts that stall the whole pool.
  """
  tpt = w.decode_s_per_token * (1 + w.occupancy_slowdown)
  slot_seconds, stall_s = 0.0, 0.0
  for c in w.classes:
    generated = c.quota / (1 - c.reject_prob)
    per_sample = tpt * mean_length(c) + w.prefill_s_per_token * c.prompt_tokens
    slot_seconds += generated * w.group_size * per_sample
    stall_s += generated * w.group_start_pause_s
  return slot_seconds / w.slots + stall_s


def trainer_tokens_per_step(w: Workload) -> float:
  """Expected prompt + response tokens the trainer consumes per train step."""
  return sum(c.quota * w.group_size * (c.prompt_tokens + mean_length(c)) for c in w.classes)


def trainer_busy_per_step(w: Workload) -> float:
  """Seconds of trainer work per train step (compute and per-step host work)."""
  return (
    w.trainer_s_per_token * trainer_tokens_per_step(w)
    + w.minibatches * w.trainer_overhead_s
    + w.trainer_step_overhead_s
  )


def calibrate_trainer(
  w: Workload, *, busy_ratio: float = 1.0, overhead_fraction: float = 0.1
) -> Workload:
  """Returns ``w`` with a trainer cost whose busy time is ``busy_ratio`` x the rollout's.

  The per-step overhead ``w.trainer_step_overhead_s`` is kept; the per-token and per-mini-batch
  terms share the rest.

  Args:
    w: the workload (its trainer fields are replaced).
    busy_ratio: trainer busy time / rollout busy time per step.
    overhead_fraction: share of the trainer time that is the fixed per-mini-batch overhead.
  """
  if busy_ratio <= 0 or not 0 <= overhead_fraction < 1:
    raise ValueError(
      f"calibrate_trainer: busy_ratio={busy_ratio!r} must be > 0 and "
      f"overhead_fraction={overhead_fraction!r} in [0, 1)."
    )
  target = busy_ratio * rollout_busy_per_step(w) - w.trainer_step_overhead_s
  if target <= 0:
    raise ValueError(
      f"calibrate_trainer: trainer_step_overhead_s={w.trainer_step_overhead_s!r} alone exceeds "
      f"busy_ratio={busy_ratio!r} x the rollout's busy time per step."
    )
  return dataclasses.replace(
    w,
    trainer_s_per_token=(1 - overhead_fraction) * target / trainer_tokens_per_step(w),
    trainer_overhead_s=overhead_fraction * target / w.minibatches,
  )
