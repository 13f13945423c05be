"""Metrics of a simulation: staleness distributions, idle fractions, throughput, Little's law.

Everything is measured over the window after the warm-up steps (the pipeline filling up is not
steady state). Staleness uses the runtime's own accounting (`knitjax.transfer.staleness`), per
trajectory: the `G` trajectories of a group share their versions, so each group counts `G` times.
"""

import numpy as np

from knitjax.sim.engine import CONSUMED, GENERATING, PENDING, QUEUED, REJECTED, SimResult
from knitjax.transfer.staleness import staleness, summarize


def counts(r: SimResult) -> dict[str, int]:
  """Where every started group is at the end: generating, pending, queued, consumed, rejected."""
  out = np.bincount(r.outcome, minlength=5)
  return {
    "started": int(r.outcome.size),
    "generating": int(out[GENERATING]),
    "completed": int(r.outcome.size - out[GENERATING]),
    "pending": int(out[PENDING]),
    "queued": int(out[QUEUED]),
    "consumed": int(out[CONSUMED]),
    "rejected": int(out[REJECTED]),
  }


def littles_law(r: SimResult) -> dict[str, float]:
  """Little's law on the groups in the system (started, not yet consumed or rejected).

  ``L`` is the time-average number in the system over the window (integrated by the event loop);
  ``lambda`` the departures (consumptions + rejections) per second in the window; ``W`` their
  mean time in the system. ``L = lambda * W`` up to edge effects at the window bounds. Since the
  policy version advances once per ``B/M`` consumed groups, mean staleness is about
  ``L_accepted / (B/M)``: the depth sets staleness, whatever the policy.
  """
  span = r.t_end - r.t_window_start
  depart = r.t_depart
  inside = (depart > r.t_window_start) & (depart <= r.t_end)
  lam = inside.sum() / span
  w = float(np.mean(depart[inside] - r.t_start[inside])) if inside.any() else float("nan")
  mean_l = r.system_area / span
  return {
    "littles_L": mean_l,
    "littles_lambda": float(lam),
    "littles_W": w,
    "littles_rel_error": abs(mean_l - lam * w) / mean_l if mean_l else 0.0,
    "staleness_from_littles_law": mean_l / r.workload.groups_per_minibatch,
  }


def summarize_result(r: SimResult) -> dict[str, float]:
  """The per-run metrics the staleness benchmark reports.

  Keys: ``arch_staleness_{mean,p50,p99,max}`` (oldest-version convention),
  ``arch_staleness_newest_*`` (newest version used, differs only with mid-generation adoption),
  ``arch_staleness_unclamped_mean`` (the mean of ``s - j`` without the clamp at 0),
  ``staleness_*`` (raw), ``staleness_generating_mean`` and ``staleness_waiting_mean`` (the raw
  mean split at group completion), ``generation_s_mean`` (start to completion of a group),
  ``trainer_idle_fraction``, ``rollout_idle_fraction`` (share of slot-time without a sample),
  ``sync_pause_fraction``, ``steps_per_hour``, ``quota_violations`` (steps or mini-batches
  released off quota: the index's ``violations``), ``stalls`` (the index's stalls plus the
  simulator's deadlock breaks), Little's-law figures and conservation counts.
  """
  w = r.workload
  span = r.t_end - r.t_window_start
  in_window = r.consumed_step >= r.warmup_steps
  gid = r.consumed_id[in_window]
  j = r.consumed_index[in_window]
  cons = r.consume_version[in_window]
  g = w.group_size
  s, arch = staleness(r.gen_version[gid], cons, j)
  _, arch_new = staleness(r.gen_version_newest[gid], cons, j)
  out = {}
  out.update(summarize(np.repeat(arch, g), "arch_staleness"))
  out.update(summarize(np.repeat(arch_new, g), "arch_staleness_newest"))
  # Without the clamp in max(0, s - j): negative where a trajectory is fresher than colocated
  # execution would have it (small rollout pools with many mini-batches per step do that).
  out["arch_staleness_unclamped_mean"] = float(np.mean(s - j)) if s.size else float("nan")
  out.update(summarize(np.repeat(s, g), "staleness"))
  # Raw staleness = versions that pass while the group generates + while it waits to be
  # consumed. Admission can only shorten the wait; generation is set by lengths and throughput.
  v_done = r.version_complete[gid]
  out["staleness_generating_mean"] = (
    float(np.mean(v_done - r.gen_version[gid])) if gid.size else 0.0
  )
  out["staleness_waiting_mean"] = float(np.mean(cons - v_done)) if gid.size else 0.0
  gen_s = r.t_complete[gid] - r.t_start[gid]
  out["generation_s_mean"] = float(np.mean(gen_s)) if gid.size else 0.0
  stats = r.index_stats
  out.update(
    {
      "steps_per_hour": (r.num_steps - r.warmup_steps) * 3600.0 / span,
      "trainer_idle_fraction": 1.0 - r.trainer_busy_s / span,
      "rollout_idle_fraction": 1.0 - r.slot_busy_s / (w.slots * span),
      "sync_pause_fraction": r.sync_pause_s / r.t_end,
      "quota_violations": int(stats["violations"]),
      "stalls": int(stats["stalls"]) + r.deadlocks,
      "deadlocks": r.deadlocks,
      "simulated_seconds": r.t_end,
      "sim_wall_s": r.wall_s,
      "trajectories_simulated": int(r.outcome.size) * g,
    }
  )
  out.update(littles_law(r))
  out.update({f"groups_{k}": v for k, v in counts(r).items()})
  return out
