"""Did a run learn? First-vs-last means of its metrics, read from its ``metrics.jsonl``.

  python -m lab.bench.reward_summary DIR [DIR ...] [--first 5] [--last 10] [--reach 0.8]
      [--keys kl,explained_variance,env_token_rows,solved_fraction]

prints, per run: the steps run, the mean ``reward_mean`` of the first ``first`` and the last
``last`` logged steps, the first step whose trailing ``last``-step mean reaches ``reach`` (how
fast it learned; "None": never), the wall clock (``wall_s`` of the last row), and the first and
last means of each of ``keys`` the run logged (default: the diagnostics of the loss menu, PPO and
multi-turn runs, ``DIAGNOSTICS``).
"""

from __future__ import annotations

import numpy as np

from knitjax.runtime.metrics import read_metrics
from lab.bench.learning import moving_average

DIAGNOSTICS = (
  "kl",
  "kl_reward_penalty",
  "explained_variance",
  "value_loss",
  "entropy",
  "env_token_rows",
  "solved_fraction",
)


def first_last(
  rows: list[dict], key: str, *, first: int = 5, last: int = 10
) -> tuple[float, float]:
  """Means of ``key`` over the first ``first`` and the last ``last`` rows (missing values skipped).

  Raises:
    ValueError: no row holds ``key``.
  """
  values = [r.get(key) for r in rows]
  if all(v is None for v in values):
    raise ValueError(f"no metrics row holds {key!r}; accepted: a key of metrics.jsonl.")

  def mean(part):
    part = [v for v in part if v is not None]
    return float(np.mean(part)) if part else float("nan")

  return mean(values[:first]), mean(values[-last:])


def summarize(
  rows: list[dict],
  *,
  first: int = 5,
  last: int = 10,
  reach: float = 0.8,
  keys: tuple[str, ...] = DIAGNOSTICS,
) -> dict:
  """``steps``, ``first_reward``, ``last_reward``, ``reach_step`` (None: never), ``wall_s``, and
  ``first_<key>`` / ``last_<key>`` for each of ``keys`` some row holds.

  Raises:
    ValueError: fewer steps with a ``reward_mean`` than ``max(first, last)``.
  """
  rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
  if len(rewards) < max(first, last):
    raise ValueError(
      f"the run has {len(rewards)} steps with a reward_mean; --first {first} / --last {last} "
      "need at least that many."
    )
  hits = np.flatnonzero(moving_average(rewards, last) >= reach)
  out = {
    "steps": len(rewards),
    "first_reward": float(np.mean(rewards[:first])),
    "last_reward": float(np.mean(rewards[-last:])),
    "reach_step": int(hits[0]) + 1 if hits.size else None,
    "wall_s": float(rows[-1].get("wall_s", float("nan"))),
  }
  for key in keys:
    if any(r.get(key) is not None for r in rows):
      out[f"first_{key}"], out[f"last_{key}"] = first_last(rows, key, first=first, last=last)
  return out


def _main(argv: list[str]) -> None:
  import argparse

  parser = argparse.ArgumentParser(prog="python -m lab.bench.reward_summary", description=__doc__)
  parser.add_argument("workdirs", nargs="+")
  parser.add_argument("--first", type=int, default=5)
  parser.add_argument("--last", type=int, default=10)
  parser.add_argument("--reach", type=float, default=0.8)
  parser.add_argument("--keys", default=",".join(DIAGNOSTICS))
  args = parser.parse_args(argv)
  keys = tuple(k for k in args.keys.split(",") if k)
  for workdir in args.workdirs:
    s = summarize(
      read_metrics(workdir), first=args.first, last=args.last, reach=args.reach, keys=keys
    )
    print(
      f"{workdir}: {s['steps']} steps, reward first {args.first} {s['first_reward']:.3f}, "
      f"last {args.last} {s['last_reward']:.3f}, trailing {args.last} reaches {args.reach} at "
      f"step {s['reach_step']}, wall {s['wall_s']:.1f} s"
    )
    for key in keys:
      if f"first_{key}" in s:
        print(f"  {key}: first {s[f'first_{key}']:.4g}, last {s[f'last_{key}']:.4g}")


if __name__ == "__main__":
  import sys

  _main(sys.argv[1:])
