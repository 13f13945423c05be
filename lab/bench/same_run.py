"""Are two runs of one seed the same run? Every learning metric both log, step by step.

  python -m lab.bench.same_run DIR_A DIR_B [--rtol 1e-4] [--atol 1e-6] [--out FILE]

reads both runs' ``metrics.jsonl`` and compares, at each step both logged, every numeric metric
both hold except the clocks (``*_s``, ``tokens_per_s``, ``wall_s``, busy and idle fractions)
and the layout's own accounting (``pack_*``, ``share_*``), which differ by design between,
say, padded rows and shared prompts (docs/prompt_sharing.md). Prints the steps compared, the
first step with a metric outside ``|a - b| <= atol + rtol |b|`` (and which metrics), the
largest relative difference over the steps before it (of values above ``100 atol``), and both
reward curves (``reward_mean``, a 25-step moving average) at a few steps and at the end.
``--out`` writes the same as JSON.

Two runs of one seed that compute the same thing up to float summation order agree to that
order while their rollouts sample the same tokens; a token whose sampling threshold falls
between the two runs' probabilities is the first real difference, after which the runs are two
samples of one distribution (compare their curves, not their numbers).
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from knitjax.runtime.metrics import read_metrics
from lab.bench.learning import moving_average

# Keys that are times, rates, or the layout's own bookkeeping: not part of what a run learns.
_SKIP_SUFFIXES = ("_s", "_per_s", "_busy_fraction", "_idle_fraction")  # clocks, as fractions
_SKIP_PREFIXES = ("pack_", "share_")
_SKIP = {"step", "version", "wall_s"}


def comparable(key: str, a, b) -> bool:
  """Whether ``key`` is a learning metric both rows hold as finite numbers."""
  if key in _SKIP or key.endswith(_SKIP_SUFFIXES) or key.startswith(_SKIP_PREFIXES):
    return False
  return all(isinstance(x, int | float) and math.isfinite(x) for x in (a, b))


def compare(rows_a: list[dict], rows_b: list[dict], *, rtol: float, atol: float) -> dict:
  """The module docstring's comparison of two runs' metric rows."""
  by_step = {r["step"]: r for r in rows_b}
  steps = [r["step"] for r in rows_a if r["step"] in by_step]
  first_diff, diff_keys, worst = None, [], 0.0
  by_step_a = {r["step"]: r for r in rows_a}
  for step in steps:
    a, b = by_step_a[step], by_step[step]
    keys = [k for k in a if k in b and comparable(k, a[k], b[k])]
    bad = [k for k in keys if abs(a[k] - b[k]) > atol + rtol * abs(b[k])]
    if bad:
      first_diff, diff_keys = step, bad
      break
    # Relative differences of the values well above atol (tiny ones are judged by atol).
    rel = [abs(a[k] - b[k]) / abs(b[k]) for k in keys if abs(b[k]) > 100 * atol]
    worst = max([worst, *rel])
  curves = {}
  for name, rows in (("a", rows_a), ("b", rows_b)):
    reward = np.array([r.get("reward_mean", np.nan) for r in rows], float)
    avg = moving_average(reward, 25) if len(reward) else reward
    curves[name] = {
      "steps": len(rows),
      "reward_first": float(reward[0]) if len(reward) else None,
      "reward_ma25_at": {
        int(rows[i]["step"]): float(avg[i]) for i in _marks(len(rows)) if i < len(avg)
      },
      "reward_ma25_last": float(avg[-1]) if len(avg) else None,
    }
  return {
    "steps_compared": len(steps),
    "rtol": rtol,
    "atol": atol,
    "first_step_apart": first_diff,
    "metrics_apart": diff_keys,
    "max_rel_diff_before": worst,
    "curves": curves,
  }


def _marks(n: int) -> list[int]:
  return sorted({i for i in (24, 99, 199, 299, 399, 499, n - 1) if 0 <= i < n})


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("run_a")
  parser.add_argument("run_b")
  parser.add_argument("--rtol", type=float, default=1e-4)
  parser.add_argument("--atol", type=float, default=1e-6)
  parser.add_argument("--out", default="")
  args = parser.parse_args(argv)
  result = compare(
    read_metrics(args.run_a), read_metrics(args.run_b), rtol=args.rtol, atol=args.atol
  )
  result.update(run_a=args.run_a, run_b=args.run_b)
  apart = result["first_step_apart"]
  print(
    f"{result['steps_compared']} steps compared; "
    + (
      "every learning metric equal within "
      if apart is None
      else f"first apart at step {apart} ({', '.join(result['metrics_apart'][:6])}); before it "
    )
    + f"rtol {args.rtol} (largest relative difference {result['max_rel_diff_before']:.2e})"
  )
  for name in ("a", "b"):
    c = result["curves"][name]
    marks = ", ".join(f"{s}: {v:.3f}" for s, v in c["reward_ma25_at"].items())
    print(f"{result['run_' + name]}: reward {c['reward_first']:.3f} -> MA25 {marks}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
