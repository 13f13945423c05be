"""Real staleness benchmark: colocated vs disaggregated runs, measured and simulated.

``run(config, workdir)`` trains the tiny long-tail task (`knitjax.tasks.longtail`: two quota
classes, short and long answers) for real:

* **frontier**: colocated (the reference), and disaggregated with each admission policy at each
  pipeline depth; every run's (throughput, architectural staleness) point is measured after its
  warmup steps. The frontier runs use a tiny learning rate so the policy, and with it the
  response-length mix, stays what it is at initialisation (a long tail for ``think``): every
  point sees the same workload, as the simulator assumes.
* **prediction**: the discrete-event simulator (`knitjax.sim`), with its cost model calibrated
  from each run's measured service times (`knitjax.sim.calibration`), predicts every
  point; the relative differences are reported, and also those of one calibration shared by all
  disaggregated points.
* **learning**: colocated, disaggregated + ``train_batch`` and disaggregated + ``minibatch`` at
  ``learning_depth``, full learning rate, for each of ``learning_seeds`` (the three runs of a
  seed share the seed and the data; `lab.bench.learning`).

Writes ``staleness_real.json`` (``policies``, ``frontier``, ``reduction``, ``throughput_gain``
as the simulated benchmark, plus ``predicted`` and ``rel_error``), ``staleness_real.png``,
``learning.json`` and ``learning.png``, and prints a table. docs/disaggregated.md has figures.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import shutil

import ml_collections as mc
import numpy as np
from matplotlib.figure import Figure  # drawn without pyplot: the caller's backend is untouched

from knitjax.config import from_config_dict
from knitjax.runtime import builder
from knitjax.sim import calibration as real_calibration
from knitjax.sim.frontier import compare
from lab.bench import learning
from lab.bench.real_runs import launch, measured_point, read_run, reused
from lab.bench.report import format_table, write_json

POLICIES = ("train_batch", "minibatch")


def _variant(config: mc.ConfigDict, *, mode, policy, depth, steps, lr) -> mc.ConfigDict:
  c = copy.deepcopy(config.train)
  c.topology.mode = mode
  c.loop.steps = steps
  c.pipeline.max_lag_steps = depth
  c.sync.adoption = config.adoption
  c.loop.log_every = max(1, steps // 4)
  c.admission.policy = policy
  c.optimizer.lr = lr
  c.checkpoint.every_steps = steps  # one checkpoint, at the end: no saves inside the window
  if mode == "disaggregated" and config.get("cluster_link_mbit", 0):
    # The rollout in one Ray actor on the rollout host's node (its one core, one device); the
    # trainer keeps the devices it had in one process (the rollout side of them sits idle). The
    # Ray address is given on the command line: it changes with each cluster.
    c.topology.rollout_workers = 1
  return c


def prompt_tokens(cfg) -> dict[str, int]:
  prompts = builder.build_prompts(cfg)
  return {c: int(len(copy.copy(s).next(1)[0].tokens)) for c, s in prompts.sources.items()}


def _key(policy: str, depth: float) -> str:
  return "colocated" if policy == "colocated" else f"{policy}_d{depth:g}"


def _runs(config: mc.ConfigDict, workdir: str, cluster=None) -> dict:
  """Launches every run; returns name -> {config, command, run, policy, depth, key}.

  ``cluster``: an emulated cluster of 3 hosts joined as one Ray cluster (`_cluster`) to run them
  in: ``(cluster, env, address)``, the trainer on host 0 (the Ray head, no CPUs), the rollout
  actor on host 1's Ray node, a colocated run on host 2 (host 0's and 1's cores together).
  """
  out = {}

  def go(name, policy, depth, steps, lr, seed=None):
    mode = "colocated" if policy == "colocated" else "disaggregated"
    cfg = _variant(
      config,
      mode=mode,
      policy=config.train.admission.policy if mode == "colocated" else policy,
      depth=depth,
      steps=steps,
      lr=lr,
    )
    if seed is not None:
      cfg.seed = seed
    launched = reused(cfg, workdir, name, steps) if config.reuse_runs else None
    if launched is None:
      spawn = None
      if cluster is not None:
        hosts, env, address = cluster
        if mode == "disaggregated":
          spawn = functools.partial(_spawn, hosts, env, address, 0)
        else:  # no Ray: the rollout takes turns with training on the same devices
          spawn = functools.partial(_spawn, hosts, env, "", 2)
      launched = launch(cfg, workdir, name, in_process=config.in_process, spawn=spawn)
    run_ = read_run(launched["workdir"])
    out[name] = {**launched, "config": cfg, "policy": policy, "depth": depth, "run": run_}
    out[name]["key"] = _key(policy, depth)
    print(f"  {name}: {len(run_['rows'])} steps, {launched['command']}", flush=True)

  points = [("colocated", 0.0)] + [(p, d) for d in config.depths for p in POLICIES]
  for rep in range(config.repeats):  # alternate the order: slow drifts of the machine cancel
    for policy, depth in points if rep % 2 == 0 else points[::-1]:
      go(
        f"frontier_{_key(policy, depth)}_r{rep}",
        policy,
        depth,
        config.frontier_steps,
        config.frontier_lr,
      )
  if config.learning_steps:
    lr = config.train.optimizer.lr
    steps = math.ceil(config.learning_factor * config.learning_steps)
    for seed in config.learning_seeds:
      go(f"learning_colocated_s{seed}", "colocated", 0.0, config.learning_steps, lr, seed)
      for policy in POLICIES:
        go(f"learning_{policy}_s{seed}", policy, config.learning_depth, steps, lr, seed)
  return out


def _frontier_runs(runs: dict) -> dict:
  return {n: r for n, r in runs.items() if n.startswith("frontier_")}


def _predict_run(config, r, costs, traces) -> dict:
  warm, steps = config.warmup_steps, config.frontier_steps
  cfg = from_config_dict(r["config"])
  tokens = prompt_tokens(cfg)
  colocated = r["policy"] == "colocated"
  w = real_calibration.disaggregated_workload(cfg, costs, traces, tokens)
  p = real_calibration.pipeline_of(cfg, colocated=colocated)
  seeds = tuple(range(config.sim_seeds))
  return real_calibration.predict(w, p, num_steps=steps, warmup_steps=warm, seeds=seeds)


def _predict_all(config, runs, shared: bool) -> dict:
  """Predicted metrics per frontier run: each run calibrated from its own timings and lengths,
  or (``shared``) every disaggregated run from the medians of all their fitted costs."""
  warm = config.warmup_steps
  frontier = _frontier_runs(runs)
  traces, costs = {}, {}
  for name, r in frontier.items():
    if r["policy"] != "colocated":
      traces[name] = real_calibration.write_traces(r["run"], r["workdir"])
      costs[name] = real_calibration.fit_costs(r["run"], warmup_steps=warm)
  if shared:
    keys = (
      "decode_s_per_iteration",
      "group_start_s",
      "trainer_minibatch_s",
      "trainer_alone_s",
      "trainer_contended_s",
      "trainer_step_overhead_s",
    )
    median = {k: float(np.median([c[k] for c in costs.values()])) for k in keys}
    costs = {n: {**c, **median} for n, c in costs.items()}
  ref = next(
    n for n, r in frontier.items() if r["key"] == _key("minibatch", config.reference_depth)
  )
  out = {}
  for name, r in frontier.items():
    if r["policy"] == "colocated":  # the colocated loop records no lengths: the reference run's
      c = real_calibration.colocated_costs(
        r["run"], from_config_dict(r["config"]), warmup_steps=warm
      )
      pred = _predict_run(config, r, c, traces[ref])
    else:
      c = costs[name]
      pred = _predict_run(config, r, c, traces[name])
    out[name] = {"max_lag_steps": r["depth"], **pred, "costs": c}
  return out


def _aggregate(per_run: dict, runs: dict) -> dict:
  """Mean of each numeric metric over the repeats of each point (violations: summed)."""
  groups: dict[str, list[dict]] = {}
  for name, m in per_run.items():
    groups.setdefault(runs[name]["key"], []).append(m)
  out = {}
  for key, ms in groups.items():
    agg = {"max_lag_steps": ms[0]["max_lag_steps"], "repeats": len(ms)}
    for k, v in ms[0].items():
      if k in ("max_lag_steps", "costs") or not isinstance(v, int | float):
        continue
      vals = [m[k] for m in ms if m.get(k) is not None]
      if k in ("quota_violations", "stalls", "groups_lost"):
        agg[k] = int(sum(vals))
      elif vals:
        agg[k] = float(np.mean(vals))
    if len(ms) > 1:
      agg["steps_per_hour_spread"] = float(np.ptp([m["steps_per_hour"] for m in ms]))
    out[key] = agg
  return out


def _errors(measured: dict, predicted: dict) -> dict:
  out = {}
  for key, m in measured.items():
    p = predicted[key]
    out[key] = {
      "max_lag_steps": m["max_lag_steps"],
      "steps_per_hour": real_calibration.rel_error(p["steps_per_hour"], m["steps_per_hour"]),
      "arch_staleness_mean": real_calibration.rel_error(
        p["arch_staleness_mean"], m["arch_staleness_mean"]
      ),
      "arch_staleness_abs_diff": p["arch_staleness_mean"] - m["arch_staleness_mean"],
    }
  return out


def _worst(errors: dict) -> float | None:
  """Largest |relative error| over all points and both metrics (None if one is undefined)."""
  keys = ("steps_per_hour", "arch_staleness_mean")
  if any(e[k] is None for e in errors.values() for k in keys):
    return None
  return max(abs(e[k]) for e in errors.values() for k in keys)


def _by_policy(points: dict) -> dict:
  out = {"colocated": [points["colocated"]]}
  for policy in POLICIES:
    pts = [p for k, p in points.items() if k.startswith(f"{policy}_d")]
    out[policy] = sorted(pts, key=lambda p: p["max_lag_steps"])
  return out


@contextlib.contextmanager
def _cluster(config: mc.ConfigDict, workdir: str):
  """Hosts for the runs, each link shaped at ``config.cluster_link_mbit`` (`lab.cluster.hosts`):
  the trainer on core 0 (a Ray head offering no CPUs), the rollout on core 1 (a Ray node of one
  CPU, where the rollout actor and its storage unit land), a colocated run on both. Yields
  ``(cluster, env, address)``: the hosts, the Ray processes' environment, the head's address."""
  from lab.cluster import net, ray_nodes
  from lab.cluster.hosts import Cluster, HostSpec

  if problem := net.missing_tools():
    raise ValueError(problem)
  if config.in_process:
    raise ValueError(
      "config.cluster_link_mbit > 0 runs the rollout in a Ray actor on a host of its own: set "
      "config.in_process=False."
    )
  rate = float(config.cluster_link_mbit)
  cores = ((0,), (1,), (0, 1))
  env = ray_nodes.ray_env(workdir)
  with Cluster([HostSpec(cores=c, rate_mbit=rate) for c in cores]) as cluster:
    temp_dir = ray_nodes.private_temp_dir(cluster.tag)  # owner-only; Ray's folder inside
    try:
      address = ray_nodes.start(cluster, env, f"{temp_dir}/ray", nodes=(1,), head_cpus=0)
      yield cluster, env, address
    finally:
      shutil.rmtree(temp_dir, ignore_errors=True)


def _spawn(cluster, ray_env: dict, address: str, host: int, argv, **popen):
  """Starts a run's trainer on ``host`` of the cluster, joined to its Ray cluster (``address``,
  "" for none) with ``ray_env`` (the run's Ray token, no inherited RAY_* settings or XLA_FLAGS)
  in place of the environment `real_runs.launch` gives."""
  popen["env"] = ray_env
  flags = [f"--config.topology.ray_address={address}"] if address else []
  return cluster.spawn(host, [*argv, *flags], **popen)


def run(config: mc.ConfigDict, workdir: str) -> dict:
  """Runs the benchmark; writes the JSON files and plots; returns the result."""
  if config.reference_depth not in config.depths:
    raise ValueError(f"config.reference_depth={config.reference_depth} is not in {config.depths}.")
  if config.get("cluster_link_mbit", 0):
    with _cluster(config, workdir) as cluster:
      runs = _runs(config, workdir, cluster)
  else:
    runs = _runs(config, workdir)
  warm = config.warmup_steps
  frontier_runs = _frontier_runs(runs)
  per_run = {
    n: measured_point(r["run"], warmup_steps=warm, max_lag_steps=r["depth"])
    for n, r in frontier_runs.items()
  }
  per_run_pred = _predict_all(config, runs, shared=False)
  per_run_shared = _predict_all(config, runs, shared=True)
  measured = _aggregate(per_run, runs)
  predicted = _aggregate(per_run_pred, runs)
  shared = _aggregate(per_run_shared, runs)
  errors, shared_errors = _errors(measured, predicted), _errors(measured, shared)
  frontier, pred_frontier = _by_policy(measured), _by_policy(predicted)
  ref = config.reference_depth
  cmp = compare(frontier["train_batch"], frontier["minibatch"], depth=ref)
  pred_cmp = compare(pred_frontier["train_batch"], pred_frontier["minibatch"], depth=ref)
  worst, worst_shared = _worst(errors), _worst(shared_errors)
  out = {
    "policies": {
      "colocated": measured["colocated"],
      **{p: measured[_key(p, ref)] for p in POLICIES},
    },
    "frontier": frontier,
    "reduction": cmp["reduction"],
    "reduction_equal_config": cmp["reduction_equal_config"],
    "throughput_gain": cmp["throughput_gain"],
    "comparison": cmp,
    "disaggregated_over_colocated_throughput": measured[_key("minibatch", ref)]["steps_per_hour"]
    / measured["colocated"]["steps_per_hour"],
    "predicted": {
      "frontier": pred_frontier,
      "reduction": pred_cmp["reduction"],
      "reduction_equal_config": pred_cmp["reduction_equal_config"],
      "throughput_gain": pred_cmp["throughput_gain"],
      "calibration": "each run from its own measured service times and lengths",
    },
    "rel_error": errors,
    "max_abs_rel_error": worst,
    "predicted_shared_calibration": {
      "frontier": _by_policy(shared),
      "rel_error": shared_errors,
      "max_abs_rel_error": worst_shared,
    },
    "checks": {
      "quota_violations_all_runs": sum(m.get("quota_violations", 0) for m in per_run.values()),
      "groups_lost_all_runs": sum(m.get("groups_lost", 0) for m in per_run.values()),
      "minibatch_dominates_train_batch": cmp["dominates"],
      "prediction_within_tolerance": worst is not None and worst <= config.tolerance,
      "tolerance": config.tolerance,
    },
    "runs": {
      n: {"measured": per_run[n], "predicted": per_run_pred[n], "command": r["command"]}
      for n, r in frontier_runs.items()
    },
    "frontier_steps": config.frontier_steps,
    "warmup_steps": warm,
    "repeats": config.repeats,
  }
  if config.learning_steps:
    lr_runs = {
      kind: [runs[f"learning_{kind}_s{seed}"] for seed in config.learning_seeds]
      for kind in ("colocated", *POLICIES)
    }
  else:  # the first repeat of the frontier runs (quick variant)
    first = {r["key"]: r for r in reversed(list(frontier_runs.values()))}
    lr_runs = {"colocated": [first["colocated"]]}
    lr_runs.update({p: [first[_key(p, config.learning_depth)]] for p in POLICIES})
  learn = learning.evaluate(
    {k: [r["run"] for r in rs] for k, rs in lr_runs.items()},
    window=config.learning_window,
    factor=config.learning_factor,
  )
  learn["depth"] = config.learning_depth
  learn["commands"] = {k: [r["command"] for r in rs] for k, rs in lr_runs.items()}
  write_json(workdir, "learning", learn)
  learning.plot(os.path.join(workdir, "learning.png"), learn)
  out["learning"] = {k: v for k, v in learn.items() if k != "curves"}
  write_json(workdir, "staleness_real", out)
  _plot(os.path.join(workdir, "staleness_real.png"), frontier, pred_frontier)
  print(_table(out, measured, predicted, errors))
  return out


def _plot(path: str, frontier: dict, predicted: dict) -> None:
  fig = Figure(figsize=(16, 4.5))
  axes = fig.subplots(1, 3)
  colors = {"colocated": "k", "train_batch": "C0", "minibatch": "C1"}
  for policy, pts in frontier.items():
    x = [p["arch_staleness_mean"] for p in pts]
    y = [p["steps_per_hour"] for p in pts]
    px = [p["arch_staleness_mean"] for p in predicted[policy]]
    py = [p["steps_per_hour"] for p in predicted[policy]]
    style = "*" if policy == "colocated" else "o-"
    axes[0].plot(x, y, style, color=colors[policy], label=f"{policy} (measured)")
    axes[0].plot(
      px,
      py,
      style.replace("-", "--"),
      color=colors[policy],
      alpha=0.5,
      label=f"{policy} (simulated)",
    )
    for p in pts:
      axes[0].annotate(
        f"{p['max_lag_steps']:g}", (p["arch_staleness_mean"], p["steps_per_hour"]), fontsize=7
      )
    for ax, key in ((axes[1], "steps_per_hour"), (axes[2], "arch_staleness_mean")):
      ax.plot(
        [p[key] for p in pts],
        [p[key] for p in predicted[policy]],
        "o",
        color=colors[policy],
        label=policy,
      )
  axes[0].set_xlabel("architectural staleness, mean (versions)")
  axes[0].set_ylabel("train steps per hour")
  axes[0].set_title("measured frontier (labels: max_lag_steps)")
  axes[0].legend(fontsize=7)
  for ax, key in ((axes[1], "steps_per_hour"), (axes[2], "arch_staleness_mean")):
    lim = max(max(ax.get_xlim()[1], ax.get_ylim()[1]), 1e-3)
    grid = np.linspace(0, lim, 10)
    ax.plot(grid, grid, "k-", lw=0.8)
    ax.fill_between(grid, 0.8 * grid, 1.2 * grid, color="gray", alpha=0.2, label="+-20%")
    ax.set_xlabel(f"measured {key}")
    ax.set_ylabel(f"simulated {key}")
    ax.legend(fontsize=7)
  for ax in axes:
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def _table(out, measured, predicted, errors) -> str:
  rows = []
  for name, m in measured.items():
    p, e = predicted[name], errors[name]
    rows.append(
      {
        "run": name,
        "steps/h": m["steps_per_hour"],
        "sim steps/h": p["steps_per_hour"],
        "err": e["steps_per_hour"],
        "arch": m["arch_staleness_mean"],
        "sim arch": p["arch_staleness_mean"],
        "err ": e["arch_staleness_mean"],
        "trainer idle": m["trainer_idle_fraction"],
        "rollout idle": m["rollout_idle_fraction"],
        "violations": m.get("quota_violations"),
      }
    )
  cols = list(rows[0])
  red, red_eq = out["reduction"], out["reduction_equal_config"]
  pct = lambda x: "None" if x is None else f"{x:.1%}"  # noqa: E731
  lr = out["learning"]
  lines = [
    format_table(rows, cols),
    "",
    f"reduction (arch staleness at matched throughput): {pct(red)}; at equal configuration: "
    f"{pct(red_eq)}; throughput_gain: {out['throughput_gain']:.3f}x; "
    f"minibatch dominates train_batch: {out['comparison']['dominates']}; "
    f"quota violations: {out['checks']['quota_violations_all_runs']}",
    f"simulator: max |rel error| {out['max_abs_rel_error']} (per-run calibration), "
    f"{out['predicted_shared_calibration']['max_abs_rel_error']} (shared calibration)",
    f"learning: target {lr['target_reward']:.3f}; reached at version/wall "
    + ", ".join(
      f"{k} {v['version']}/{v['wall_s'] and round(v['wall_s'], 1)}s"
      for k, v in lr["reached"].items()
    )
    + f"; minibatch within {lr['version_budget']:.0f} versions: {lr['minibatch_within_budget']} "
    f"(seed-averaged; {lr['minibatch_within_budget_seeds']}/{lr['seeds']} seeds)",
  ]
  return "\n".join(lines)
