"""Learning quality: reward against optimizer steps and wall clock, over several seeds.

For each seed the three runs (colocated, disaggregated + ``train_batch``, disaggregated +
``minibatch``) share the seed and the data. RL on the tiny task is noisy (when a run "takes
off" varies by hundreds of steps between seeds, ../shared/NOTES.md), so the criterion is judged
on the seed-averaged curves, and reported per seed as well.

The target is the colocated final reward: the mean of the last ``window`` steps of the
(averaged) colocated curve. A curve reaches it at the first step whose trailing ``window``-step
moving average is at least the target; the issue's criterion is that disaggregated +
``minibatch`` reaches it within ``factor`` (1.1) times the colocated run's optimizer steps.
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


def _judge(curves: dict, window: int, factor: float) -> dict:
  coloc = curves["colocated"]
  target = float(np.mean(coloc["reward"][-window:]))
  budget = factor * coloc["version"][-1]
  reached = {name: reach(c, target) for name, c in curves.items()}
  mb = reached["minibatch"]["version"]
  return {
    "target_reward": target,
    "colocated_versions": coloc["version"][-1],
    "version_budget": budget,
    "reached": reached,
    "final_reward": {n: float(np.mean(c["reward"][-window:])) for n, c in curves.items()},
    "minibatch_within_budget": mb is not None and mb <= budget,
  }


def evaluate(runs: dict[str, list[dict]], *, window: int, factor: float = 1.1) -> dict:
  """``learning.json`` content; ``runs`` maps colocated / train_batch / minibatch to per-seed
  runs (the same seeds, in the same order)."""
  curves = {name: curve(rs, window=window) for name, rs in runs.items()}
  seeds = len(runs["colocated"])
  per_seed = [
    _judge({n: curve([rs[k]], window=window) for n, rs in runs.items()}, window, factor)
    for k in range(seeds)
  ]
  return {
    **_judge(curves, window, factor),
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
