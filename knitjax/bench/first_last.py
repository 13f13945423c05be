"""A run's learning at a glance: metric means over its first and last train steps.

  python -m knitjax.bench.first_last WORKDIR [--keys reward_mean,env_token_rows] [--first 5]
      [--last 10]

prints, for each key, the mean over the first ``first`` and the last ``last`` rows of
``WORKDIR/metrics.jsonl``, and the run's wall time (``wall_s`` of the last row).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from knitjax.runtime.metrics import read_metrics


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


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(prog="python -m knitjax.bench.first_last", description=__doc__)
  parser.add_argument("workdir")
  parser.add_argument("--keys", default="reward_mean")
  parser.add_argument("--first", type=int, default=5)
  parser.add_argument("--last", type=int, default=10)
  args = parser.parse_args(argv)
  rows = read_metrics(args.workdir)
  if not rows:
    raise SystemExit(f"{args.workdir}/metrics.jsonl has no rows.")
  print(f"{args.workdir}: {len(rows)} steps, wall {rows[-1].get('wall_s', float('nan')):.1f} s")
  for key in args.keys.split(","):
    a, b = first_last(rows, key, first=args.first, last=args.last)
    print(f"{key}: first {args.first} steps {a:.3f}, last {args.last} steps {b:.3f}")


if __name__ == "__main__":
  main(sys.argv[1:])
