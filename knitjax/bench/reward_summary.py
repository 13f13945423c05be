"""Did a run learn? Mean reward of its first and last steps, read from its ``metrics.jsonl``.

  python -m knitjax.bench.reward_summary WORKDIR [WORKDIR ...] [--first 5] [--last 10]

prints, per run, the mean ``reward_mean`` of the first ``first`` and the last ``last`` logged
steps, their wall clock (``wall_s`` of the last row) and, when logged, the last steps' mean of a
few diagnostics (``kl``, ``explained_variance``, ``value_loss``, ``entropy``).
"""

from __future__ import annotations

import numpy as np

from knitjax.runtime.metrics import read_metrics

DIAGNOSTICS = ("kl", "kl_reward_penalty", "explained_variance", "value_loss", "entropy")


def summarize(rows: list[dict], *, first: int = 5, last: int = 10) -> dict[str, float]:
  """``first_mean``, ``last_mean``, ``steps``, ``wall_s`` and the last steps' diagnostics.

  Raises:
    ValueError: fewer than ``first + last`` rows (the two windows would overlap).
  """
  if len(rows) < first + last:
    raise ValueError(f"{len(rows)} logged steps; need at least first + last = {first + last}.")
  reward = np.array([r["reward_mean"] for r in rows], np.float64)
  out = {
    "steps": float(rows[-1]["step"]),
    "first_mean": float(reward[:first].mean()),
    "last_mean": float(reward[-last:].mean()),
    "wall_s": float(rows[-1].get("wall_s", float("nan"))),
  }
  for key in DIAGNOSTICS:
    if all(key in r for r in rows[-last:]):
      out[f"last_{key}"] = float(np.mean([r[key] for r in rows[-last:]]))
  return out


def _main(argv: list[str]) -> None:
  import argparse

  parser = argparse.ArgumentParser(
    prog="python -m knitjax.bench.reward_summary", description=__doc__
  )
  parser.add_argument("workdirs", nargs="+")
  parser.add_argument("--first", type=int, default=5)
  parser.add_argument("--last", type=int, default=10)
  args = parser.parse_args(argv)
  for workdir in args.workdirs:
    s = summarize(read_metrics(workdir), first=args.first, last=args.last)
    extra = "  ".join(
      f"{k}={v:.4g}" for k, v in s.items() if k.startswith("last_") and k != "last_mean"
    )
    print(
      f"{workdir}: steps {s['steps']:.0f}  first-{args.first} {s['first_mean']:.3f}  "
      f"last-{args.last} {s['last_mean']:.3f}  wall {s['wall_s']:.0f}s  {extra}"
    )


if __name__ == "__main__":
  import sys

  _main(sys.argv[1:])
