"""Staleness benchmark: admission policies on the simulated cluster, compared on the frontier.

``run(config, workdir)`` simulates every policy (`train_batch`, `minibatch`, `greedy`) over the
pipeline depths 0, 1/M, ..., ``max_depth`` plus the colocated reference, and writes
``staleness.json`` (``policies``, ``frontier``, ``reduction``, ``throughput_gain`` and the
supporting comparisons), ``staleness.png`` and a printed table. See docs/simulator.md.
"""

import copy
import dataclasses
import math
import os

import ml_collections as mc
import numpy as np
from matplotlib.figure import Figure  # drawn without pyplot: the caller's backend is untouched

from knitjax.sim import costs
from knitjax.sim.engine import SimResult, simulate
from knitjax.sim.frontier import POINT_KEYS, compare, depth_grid, run_frontier
from knitjax.sim.metrics import summarize_result
from knitjax.sim.workload import ClassSpec, Pipeline, Workload
from knitjax.transfer.admission import POLICIES
from knitjax.transfer.staleness import staleness
from lab.bench.report import format_table, write_json

_CLASS_FIELDS = tuple(f.name for f in dataclasses.fields(ClassSpec) if f.name != "name")
_WORKLOAD_FIELDS = tuple(f.name for f in dataclasses.fields(Workload) if f.name != "classes")


def workload_from_config(config: mc.ConfigDict) -> Workload:
  """The `Workload` the config describes, with the trainer calibrated when asked."""
  names = [n.strip() for n in config.class_order.split(",") if n.strip()]
  if sorted(names) != sorted(config.classes.keys()):
    raise ValueError(
      f"config.class_order={config.class_order!r} must list exactly the classes "
      f"{sorted(config.classes.keys())}."
    )
  classes = tuple(
    ClassSpec(name=n, **{k: config.classes[n][k] for k in _CLASS_FIELDS if k in config.classes[n]})
    for n in names
  )
  w = Workload(classes=classes, **{k: config[k] for k in _WORKLOAD_FIELDS})
  if config.calibrate_trainer:
    w = costs.calibrate_trainer(
      w, busy_ratio=config.trainer_busy_ratio, overhead_fraction=config.trainer_overhead_fraction
    )
  return w


def pipeline_from_config(config: mc.ConfigDict, **changes) -> Pipeline:
  """The base `Pipeline` of the config (policy and depth are set per run)."""
  base = Pipeline(
    weight_sync=config.weight_sync,
    adoption=config.adoption,
    scheduling=config.scheduling,
    lag_unit=config.get("lag_unit", "step"),
    max_inflight_groups=config.max_inflight_groups,
    max_lag_steps=config.reference_depth,
  )
  return dataclasses.replace(base, **changes)


def with_overrides(config: mc.ConfigDict, overrides) -> mc.ConfigDict:
  """A copy of ``config`` with ``((dotted.field, value), ...)`` applied."""
  out = copy.deepcopy(config)
  for path, value in overrides:
    *parents, leaf = path.split(".")
    node = out
    for p in parents:
      node = node[p]
    if leaf not in node:
      raise ValueError(f"sweep override {path!r} names no config field.")
    node[leaf] = value
  return out


def _with_rejection(config: mc.ConfigDict) -> mc.ConfigDict:
  pairs = []
  for item in config.dynamic_sampling_reject.split(","):
    name, _, p = item.partition(":")
    pairs.append((f"classes.{name.strip()}.reject_prob", float(p)))
  return with_overrides(config, pairs)


def _calibration(w: Workload) -> dict:
  return {
    "rollout_busy_s_per_step": costs.rollout_busy_per_step(w),
    "trainer_busy_s_per_step": costs.trainer_busy_per_step(w),
    "trainer_tokens_per_step": costs.trainer_tokens_per_step(w),
    "ideal_steps_per_hour": 3600.0
    / max(costs.rollout_busy_per_step(w), costs.trainer_busy_per_step(w)),
    "mean_length": {c.name: costs.mean_length(c) for c in w.classes},
  }


def _frontiers(config, w, base, policies, steps, warmup):
  depths = depth_grid(w.minibatches, config.max_depth)
  if not any(abs(d - config.reference_depth) < 1e-9 for d in depths):
    raise ValueError(
      f"config.reference_depth={config.reference_depth!r} is not on the depth grid {depths}."
    )
  frontier, results = {}, {}
  for policy in policies:
    pts, res = run_frontier(
      w,
      dataclasses.replace(base, policy=policy),
      depths,
      num_steps=steps,
      warmup_steps=warmup,
      seed=config.seed,
    )
    frontier[policy] = pts
    results[policy] = res
  return frontier, results


def _ref(results, depth):
  return next(r for d, r in results.items() if abs(d - depth) < 1e-9)


def run(config: mc.ConfigDict, workdir: str) -> dict:
  """Runs the benchmark; writes ``staleness.json`` and ``staleness.png``; returns the result."""
  w = workload_from_config(config)
  base = pipeline_from_config(config)
  ref = config.reference_depth
  steps, warmup = config.num_steps, config.warmup_steps
  frontier, results = _frontiers(config, w, base, POLICIES, steps, warmup)
  coloc = simulate(
    w,
    dataclasses.replace(base, policy="train_batch", mode="colocated", max_lag_steps=0.0),
    num_steps=steps,
    warmup_steps=warmup,
    seed=config.seed,
  )
  coloc_m = summarize_result(coloc)
  frontier["colocated"] = [{"max_lag_steps": 0.0, **{k: coloc_m[k] for k in POINT_KEYS}}]
  ref_results = {p: _ref(results[p], ref) for p in POLICIES}
  policies = {p: {"max_lag_steps": ref, **summarize_result(r)} for p, r in ref_results.items()}
  policies["colocated"] = {"max_lag_steps": 0.0, **coloc_m}
  cmp = compare(frontier["train_batch"], frontier["minibatch"], depth=ref)
  mb_points = frontier["minibatch"]
  out = {
    "policies": policies,
    "frontier": frontier,
    "reduction": cmp["reduction"],
    "throughput_gain": cmp["throughput_gain"],
    "comparison": cmp,
    "generation_bound": _generation_bound(w, cmp, frontier["minibatch"]),
    "checks": {
      "minibatch_quota_violations_all_depths": sum(p["quota_violations"] for p in mb_points),
      "minibatch_stalls_all_depths": sum(p["stalls"] for p in mb_points),
      "greedy_quota_violations_all_depths": sum(p["quota_violations"] for p in frontier["greedy"]),
      "minibatch_dominates_train_batch": cmp["dominates"],
    },
    "workload": dataclasses.asdict(w),
    "pipeline": dataclasses.asdict(base),
    "calibration": _calibration(w),
    "num_steps": steps,
    "warmup_steps": warmup,
    "seed": config.seed,
  }
  two = ("train_batch", "minibatch")
  if config.compare_adoption:
    other = "mid_generation" if base.adoption == "new_groups" else "new_groups"
    fr, _ = _frontiers(config, w, dataclasses.replace(base, adoption=other), two, steps, warmup)
    out["adoption"] = {
      other: {
        "frontier": fr,
        "oldest": compare(fr["train_batch"], fr["minibatch"], depth=ref),
        "newest": compare(
          fr["train_batch"], fr["minibatch"], depth=ref, key="arch_staleness_newest_mean"
        ),
      }
    }
  if config.compare_weight_sync:
    other = "step" if base.weight_sync == "minibatch" else "minibatch"
    fr, _ = _frontiers(config, w, dataclasses.replace(base, weight_sync=other), two, steps, warmup)
    out["weight_sync"] = {
      other: {"frontier": fr, **compare(fr["train_batch"], fr["minibatch"], depth=ref)}
    }
  if config.compare_scheduling:
    out["scheduling"] = _scheduling(config, w, base, steps, warmup, frontier)
  out["sweep"] = [_sweep_entry(config, name, ov) for name, ov in config.sweep]
  if config.speed_trajectories:
    out["speed"] = _speed(w, base, config)
  write_json(workdir, "staleness", out)
  _plot(os.path.join(workdir, "staleness.png"), frontier, ref_results, coloc, out["sweep"])
  print(_table(out))
  return out


def _generation_bound(w: Workload, cmp: dict, candidate: list[dict]) -> dict:
  """How far any admission policy could cut staleness at the baseline's throughput.

  A group's raw staleness is at least the versions that pass while it generates, about
  ``versions per second x generation time``; architectural staleness ``max(0, s - j)`` is then
  at least that minus the mean colocated gap ``(M - 1) / 2``. Admission can only remove waiting.
  Per mini-batch position ``j`` the floor is ``max(0, generating - j)``; its mean over the M
  positions (``arch_staleness_floor_per_position``) is tighter than the floor of the mean gap
  (the clamp is convex), so ``max_reduction_per_position`` is the bound to quote.
  """
  base = cmp["baseline"]
  rate = base["steps_per_hour"] * w.minibatches / 3600.0
  matched_depth = cmp["matched_depth"] if cmp["matched_depth"] is not None else 0.0
  point = next(p for p in candidate if abs(p["max_lag_steps"] - matched_depth) < 1e-9)
  generating = rate * point["generation_s_mean"]
  floor = max(0.0, generating - (w.minibatches - 1) / 2)
  per_position = [max(0.0, generating - j) for j in range(w.minibatches)]
  floor_pos = sum(per_position) / w.minibatches
  arch = base["arch_staleness_mean"]
  return {
    "versions_per_s": rate,
    "generation_s_mean": point["generation_s_mean"],
    "generating_versions": generating,
    "arch_staleness_floor": floor,
    "max_reduction": 1.0 - floor / arch if arch > 0 else None,
    "arch_staleness_floor_by_position": per_position,
    "arch_staleness_floor_per_position": floor_pos,
    "max_reduction_per_position": 1.0 - floor_pos / arch if arch > 0 else None,
  }


def _scheduling(config, w, base, steps, warmup, frontier) -> dict:
  """Plain vs admission-aware scheduling, on the reference and a dynamic-sampling workload."""
  two = ("train_batch", "minibatch")
  ref = config.reference_depth
  out = {}
  w_ds = workload_from_config(_with_rejection(config))
  for label, wl in (("reference", w), ("dynamic_sampling", w_ds)):
    entry = {}
    for sched in ("plain", "admission_aware"):
      if wl is w and sched == base.scheduling:
        fr = {p: frontier[p] for p in two}
      else:
        fr, _ = _frontiers(
          config, wl, dataclasses.replace(base, scheduling=sched), two, steps, warmup
        )
      c = compare(fr["train_batch"], fr["minibatch"], depth=ref)
      entry[sched] = {"frontier": fr, **c}
    out[label] = entry
  out["dynamic_sampling_reject"] = config.dynamic_sampling_reject
  return out


def _sweep_entry(config, name, overrides) -> dict:
  cfg = with_overrides(config, overrides)
  w = workload_from_config(cfg)
  base = pipeline_from_config(cfg)
  fr, _ = _frontiers(
    cfg, w, base, ("train_batch", "minibatch"), cfg.sweep_num_steps, cfg.sweep_warmup_steps
  )
  c = compare(fr["train_batch"], fr["minibatch"], depth=cfg.reference_depth)
  return {
    "name": name,
    "overrides": [list(o) for o in overrides],
    "reduction": c["reduction"],
    "throughput_gain": c["throughput_gain"],
    "comparison": c,
    "generation_bound": _generation_bound(w, c, fr["minibatch"]),
    "ideal_steps_per_hour": _calibration(w)["ideal_steps_per_hour"],
    "frontier": fr,
  }


def _speed(w: Workload, base: Pipeline, config) -> dict:
  steps = math.ceil(config.speed_trajectories / (w.groups_per_step * w.group_size))
  r = simulate(w, dataclasses.replace(base, policy="minibatch"), num_steps=steps, seed=config.seed)
  n = int(r.outcome.size) * w.group_size
  return {
    "trajectories": n,
    "groups": int(r.outcome.size),
    "steps": steps,
    "wall_s": r.wall_s,
    "trajectories_per_s": n / r.wall_s,
  }


def _arch_values(r: SimResult) -> np.ndarray:
  keep = r.consumed_step >= r.warmup_steps
  gid = r.consumed_id[keep]
  _, arch = staleness(r.gen_version[gid], r.consume_version[keep], r.consumed_index[keep])
  return arch


def _plot(path, frontier, ref_results, coloc, sweep) -> None:
  ncols = 3 if sweep else 2
  fig = Figure(figsize=(5.5 * ncols, 4.5))
  axes = fig.subplots(1, ncols)
  ax = axes[0]
  for policy, pts in frontier.items():
    x = [p["arch_staleness_mean"] for p in pts]
    y = [p["steps_per_hour"] for p in pts]
    if policy == "colocated":
      ax.plot(x, y, "k*", markersize=12, label="colocated")
      continue
    ax.plot(x, y, "o-", label=policy)
    for p in pts:
      ax.annotate(
        f"{p['max_lag_steps']:g}", (p["arch_staleness_mean"], p["steps_per_hour"]), fontsize=6
      )
  ax.set_xlabel("architectural staleness, mean (versions)")
  ax.set_ylabel("train steps per hour")
  ax.set_title("frontier over depth (labels: max_lag_steps)")
  ax.legend()
  ax.grid(alpha=0.3)
  ax = axes[1]
  runs = dict(ref_results, colocated=coloc)
  top = max(int(_arch_values(r).max(initial=0)) for r in runs.values())
  for policy, r in runs.items():
    arch = _arch_values(r)
    if arch.size:
      freq = np.bincount(arch, minlength=top + 1) / arch.size
      ax.plot(np.arange(top + 1), freq, "o-", drawstyle="steps-mid", markersize=3, label=policy)
  ax.set_xlabel("architectural staleness (versions)")
  ax.set_ylabel("fraction of trajectories")
  ax.set_title("distribution at the reference depth")
  ax.legend()
  ax.grid(alpha=0.3)
  if sweep:
    ax = axes[2]
    names = [s["name"] for s in sweep]
    red = [s["reduction"] if s["reduction"] is not None else 0.0 for s in sweep]
    ax.bar(range(len(names)), red)
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("reduction of arch staleness at matched throughput")
    ax.set_title("sweep (None shown as 0)")
    ax.grid(alpha=0.3, axis="y")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def _table(out: dict) -> str:
  cols = [
    "policy",
    "max_lag_steps",
    "steps_per_hour",
    "arch_staleness_mean",
    "arch_staleness_p99",
    "arch_staleness_newest_mean",
    "staleness_mean",
    "trainer_idle_fraction",
    "rollout_idle_fraction",
    "quota_violations",
    "stalls",
  ]
  rows = [{"policy": p, **m} for p, m in out["policies"].items()]
  lines = [format_table(rows, cols), ""]
  c = out["comparison"]
  red = "None" if out["reduction"] is None else f"{out['reduction']:.1%}"
  eq = c.get("reduction_equal_config")
  eq = "None" if eq is None else f"{eq:.1%}"
  lines.append(
    f"reduction (arch staleness at matched throughput): {red} "
    f"(minibatch at depth {c['matched_depth']} vs train_batch at depth {c['baseline_depth']}); "
    f"throughput_gain at depth {c['baseline_depth']}: {out['throughput_gain']:.3f}x; "
    f"minibatch dominates: {c['dominates']} (throughputs within {c['rtol']:.1%} tie); "
    f"at equal configuration (both at depth {c['baseline_depth']}): {eq}"
  )
  g = out["generation_bound"]
  if g["max_reduction"] is not None:
    lines.append(
      f"generation bound: groups take {g['generation_s_mean']:.0f} s = "
      f"{g['generating_versions']:.2f} versions to generate at that throughput, so no admission "
      f"policy gets arch staleness below ~{g['arch_staleness_floor']:.2f} "
      f"(reduction <= {g['max_reduction']:.0%}); per mini-batch position "
      f"~{g['arch_staleness_floor_per_position']:.2f} "
      f"(reduction <= {g['max_reduction_per_position']:.0%})"
    )
  for s in out["sweep"]:
    r = "None" if s["reduction"] is None else f"{s['reduction']:.1%}"
    bound = s["generation_bound"]["max_reduction_per_position"]
    b = "None" if bound is None else f"{bound:.0%}"
    lines.append(
      f"sweep {s['name']}: reduction {r} (generation bound {b}), "
      f"throughput_gain {s['throughput_gain']:.3f}x"
    )
  if "speed" in out:
    sp = out["speed"]
    lines.append(
      f"simulator speed: {sp['trajectories']} trajectories in {sp['wall_s']:.1f} s "
      f"({sp['trajectories_per_s']:.0f}/s)"
    )
  return "\n".join(lines)
