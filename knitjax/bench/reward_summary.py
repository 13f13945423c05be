"""First-vs-last reward of finished runs: has a run learned?

For each workdir, reads ``metrics.jsonl`` and prints the mean ``reward_mean`` of the first
``first`` train steps and of the last ``last`` ones, the steps run and the wall clock::

  python -m knitjax.bench.reward_summary DIR [DIR ...] [--first 5] [--last 10]
"""

from __future__ import annotations

import numpy as np

from knitjax.runtime.metrics import read_metrics


def summarize(rows: list[dict], *, first: int = 5, last: int = 10) -> dict:
  """Mean reward of the first ``first`` and last ``last`` steps, the step count and the wall
  clock of the last row (``wall_s``: seconds from the process's first step)."""
  rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
  if len(rewards) < max(first, last):
    raise ValueError(
      f"the run has {len(rewards)} steps with a reward_mean; --first {first} / --last {last} "
      "need at least that many."
    )
  return {
    "steps": len(rewards),
    f"first{first}_reward": float(np.mean(rewards[:first])),
    f"last{last}_reward": float(np.mean(rewards[-last:])),
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
  args = parser.parse_args(argv)
  print(f"{'workdir':<40}{'steps':>7}{'first':>9}{'last':>9}{'wall_s':>9}")
  for workdir in args.workdirs:
    s = summarize(read_metrics(workdir), first=args.first, last=args.last)
    cells = (s["steps"], s[f"first{args.first}_reward"], s[f"last{args.last}_reward"], s["wall_s"])
    print(f"{workdir:<40}{cells[0]:>7}{cells[1]:>9.3f}{cells[2]:>9.3f}{cells[3]:>9.1f}")


if __name__ == "__main__":
  import sys

  _main(sys.argv[1:])
