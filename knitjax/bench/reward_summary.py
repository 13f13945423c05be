"""First-vs-last reward of finished runs: has a run learned?

For each workdir, reads ``metrics.jsonl`` and prints the mean ``reward_mean`` of the first
``first`` train steps and of the last ``last`` ones, the first step whose trailing ``last``-step
mean reaches ``reach`` (how fast it learned), the steps run and the wall clock::

  python -m knitjax.bench.reward_summary DIR [DIR ...] [--first 5] [--last 10] [--reach 0.8]
"""

from __future__ import annotations

import numpy as np

from knitjax.bench.learning import moving_average
from knitjax.runtime.metrics import read_metrics


def summarize(rows: list[dict], *, first: int = 5, last: int = 10, reach: float = 0.8) -> dict:
  """Mean reward of the first ``first`` and last ``last`` steps, the first step whose trailing
  ``last``-step mean is at least ``reach`` (None: never), the step count and the wall clock of
  the last row (``wall_s``: seconds from the process's first step)."""
  rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
  if len(rewards) < max(first, last):
    raise ValueError(
      f"the run has {len(rewards)} steps with a reward_mean; --first {first} / --last {last} "
      "need at least that many."
    )
  hits = np.flatnonzero(moving_average(rewards, last) >= reach)
  return {
    "steps": len(rewards),
    f"first{first}_reward": float(np.mean(rewards[:first])),
    f"last{last}_reward": float(np.mean(rewards[-last:])),
    "reach_step": int(hits[0]) + 1 if hits.size else None,
    "wall_s": float(rows[-1].get("wall_s", float("nan"))),
  }


def _main(argv: list[str]) -> None:
  import argparse

  parser = argparse.ArgumentParser(
    prog="python -m knitjax.bench.reward_summary", description=__doc__
  )
  parser.add_argument("workdirs", nargs="+")
  parser.add_argument("--first", type=int, default=5)
  parser.add_argument("--last", type=int, default=10)
  parser.add_argument("--reach", type=float, default=0.8)
  args = parser.parse_args(argv)
  first, last = f"first{args.first}", f"last{args.last}"
  print(f"{'workdir':<32}{'steps':>7}{first:>9}{last:>9}{f'reach {args.reach}':>11}{'wall_s':>9}")
  for workdir in args.workdirs:
    s = summarize(read_metrics(workdir), first=args.first, last=args.last, reach=args.reach)
    cells = (s["steps"], s[f"{first}_reward"], s[f"{last}_reward"], str(s["reach_step"]))
    print(
      f"{workdir:<32}{cells[0]:>7}{cells[1]:>9.4f}{cells[2]:>9.4f}{cells[3]:>11}{s['wall_s']:>9.1f}"
    )


if __name__ == "__main__":
  import sys

  _main(sys.argv[1:])
