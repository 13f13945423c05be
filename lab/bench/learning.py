"""Learning quality: reward against optimizer steps and wall clock, over several seeds.

For each seed the three runs (colocated, disaggregated + ``train_batch``, disaggregated +
``minibatch``) share the seed and the data. RL on the tiny task is noisy (when a run "takes
off" varies by hundreds of steps between seeds, docs/disaggregated.md), so the criterion is judged
on the seed-averaged curves, and reported per seed as well.

A curve reaches a target at the first step whose trailing ``window``-step moving average is
at least the target. Two targets are judged:

* the colocated final reward, the mean of the last ``window`` steps of the (averaged) colocated
  curve (the issue's criterion: disaggregated + ``minibatch`` reaches it within ``factor`` (1.1)
  times the colocated run's optimizer steps). Read it with care: the colocated curve's own
  moving average ends at this target, so colocated reaches it near its last step *by
  construction*, while a run whose reward rose earlier and higher reaches it sooner;
* a fixed reward (``fixed_target``, 0.5 by default) that no run defines: the versions each mode
  needs to reach it compare the three runs on equal terms (``reached_fixed``).

Re-judge finished runs without re-running them (reads each run's ``metrics.jsonl``)::

  python -m lab.bench.learning DIR [--fixed_target 0.5]

where ``DIR`` is a ``staleness_real`` workdir (its ``runs/learning_<mode>_s<seed>`` folders).
"""

from __future__ import annotations

import os

import numpy as np


def moving_average(x, window: int) -> np.ndarray:
  """Trailing mean over up to ``window`` values (shorter at the start)."""
  x = np.asarray(x, np.float64)
  c = np.cumsum(np.insert(x, 0, 0.0))
  i = np.arange(1, len(x) + 1)
  n = np.minimum(i, window)
  return (c[i] - c[i - n]) / n


def curve(runs: list[dict], *, window: int) -> dict:
  """The seed-averaged curve of runs of one mode (truncated to the shortest run)."""
  n = min(len(r["rows"]) for r in runs)
  rows = runs[0]["rows"][:n]
  reward = np.mean([[row["reward_mean"] for row in r["rows"][:n]] for r in runs], axis=0)
  wall = np.mean([r["wall"][:n] for r in runs], axis=0)
  return {
    "step": [row["step"] for row in rows],
    "version": [row["version"] for row in rows],
    "wall_s": wall.tolist(),
    "reward": reward.tolist(),
    "reward_moving_average": moving_average(reward, window).tolist(),
  }


def reach(c: dict, target: float) -> dict:
  """First step whose moving average reaches ``target``: its version and wall clock, or None."""
  hits = np.flatnonzero(np.asarray(c["reward_moving_average"]) >= target)
  if not hits.size:
    return {"step": None, "version": None, "wall_s": None}
  i = int(hits[0])
  return {"step": c["step"][i], "version": c["version"][i], "wall_s": c["wall_s"][i]}


def _judge(curves: dict, window: int, factor: float, fixed_target: float) -> dict:
  coloc = curves["colocated"]
  target = float(np.mean(coloc["reward"][-window:]))
  budget = factor * coloc["version"][-1]
  reached = {name: reach(c, target) for name, c in curves.items()}
  mb = reached["minibatch"]["version"]
  return {
    "fixed_target": fixed_target,
    "reached_fixed": {name: reach(c, fixed_target) for name, c in curves.items()},
    "target_reward": target,
    "colocated_versions": coloc["version"][-1],
    "version_budget": budget,
    "reached": reached,
    "final_reward": {n: float(np.mean(c["reward"][-window:])) for n, c in curves.items()},
    "minibatch_within_budget": mb is not None and mb <= budget,
  }


def evaluate(
  runs: dict[str, list[dict]], *, window: int, factor: float = 1.1, fixed_target: float = 0.5
) -> dict:
  """``learning.json`` content; ``runs`` maps colocated / train_batch / minibatch to per-seed
  runs (the same seeds, in the same order)."""
  curves = {name: curve(rs, window=window) for name, rs in runs.items()}
  seeds = len(runs["colocated"])
  per_seed = [
    _judge(
      {n: curve([rs[k]], window=window) for n, rs in runs.items()}, window, factor, fixed_target
    )
    for k in range(seeds)
  ]
  return {
    **_judge(curves, window, factor, fixed_target),
    "target": f"colocated final reward: mean of the last {window} steps, seed-averaged",
    "window": window,
    "seeds": seeds,
    "per_seed": per_seed,
    "minibatch_within_budget_seeds": sum(s["minibatch_within_budget"] for s in per_seed),
    "curves": curves,
  }


def plot(path: str, result: dict) -> None:
  """``learning.png``: averaged reward against optimizer steps and against wall clock."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for name, c in result["curves"].items():
    axes[0].plot(c["version"], c["reward_moving_average"], label=name)
    axes[1].plot(c["wall_s"], c["reward_moving_average"], label=name)
  labels = ("optimizer steps (policy version)", "wall clock (s)")
  for ax, xlabel in zip(axes, labels, strict=True):
    ax.axhline(result["target_reward"], color="k", ls=":", lw=1, label="colocated final")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"reward, {result['window']}-step avg, mean of {result['seeds']} seeds")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
  axes[0].axvline(result["version_budget"], color="gray", ls="--", lw=1)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _main(argv: list[str]) -> None:
  import argparse
  import glob
  import re

  from lab.bench.real_runs import read_run

  parser = argparse.ArgumentParser(prog="python -m lab.bench.learning", description=__doc__)
  parser.add_argument("workdir", help="a staleness_real workdir (has runs/learning_*_s*)")
  parser.add_argument("--fixed_target", type=float, default=0.5)
  parser.add_argument("--window", type=int, default=20)
  parser.add_argument("--factor", type=float, default=1.1)
  args = parser.parse_args(argv)
  found: dict[str, dict[int, dict]] = {}
  for folder in sorted(glob.glob(os.path.join(args.workdir, "runs", "learning_*_s*"))):
    m = re.fullmatch(r"learning_(\w+)_s(\d+)", os.path.basename(folder))
    if m:
      found.setdefault(m.group(1), {})[int(m.group(2))] = read_run(folder)
  if set(found) != {"colocated", "train_batch", "minibatch"}:
    raise SystemExit(f"{args.workdir}/runs has learning runs for {sorted(found)}, not all 3 modes.")
  seeds = sorted(found["colocated"])
  runs = {mode: [by_seed[s] for s in seeds] for mode, by_seed in found.items()}
  result = evaluate(runs, window=args.window, factor=args.factor, fixed_target=args.fixed_target)
  print(f"seeds {seeds}; versions to reach (trailing {args.window}-step mean reward):")
  print(f"{'target':<28}" + "".join(f"{m:>13}" for m in runs))
  for label, key, judged in [
    (f"colocated final {result['target_reward']:.3f}", "reached", result),
    (f"fixed {args.fixed_target:.3f}", "reached_fixed", result),
    *[
      (f"  seed {s}, fixed", "reached_fixed", per)
      for s, per in zip(seeds, result["per_seed"], strict=True)
    ],
  ]:
    cells = "".join(f"{str(judged[key][m]['version']):>13}" for m in runs)
    print(f"{label:<28}{cells}")


if __name__ == "__main__":
  import sys

  _main(sys.argv[1:])
