"""Step-time benchmark: median seconds per full colocated GRPO step.

It runs the real training loop (:func:`knitjax.runtime.colocated.run`) and
reads each step's times from ``metrics.jsonl``, so what is timed is what a
user runs: sampling, rewards, storage, admission, batch assembly and the
jitted update (with a reference forward when ``kl_coef > 0``).

Two figures per step: ``wall_median_s``, end to end (the time between the ends of
consecutive steps, from ``wall_s``: it includes the per-step host work outside the
step body — metrics row, checkpoint decision, the next step's set-up), which is
what the baseline script measures too and what the headline ``ratio`` compares;
and ``median_s``, the step body alone (``step_s``), reported as ``ratio_step_s``.

With ``config.baseline_python`` set (the python of a throwaway venv holding an
external system, e.g. Tunix 0.1.7), each of ``config.rounds`` rounds runs the
baseline script in a subprocess and then knitjax, back to back, and the JSON
reports the per-round ratio ``baseline median / knitjax median``: on a shared,
noisy machine only ratios measured side by side mean anything.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np

from knitjax.config import from_config_dict
from knitjax.distributed.topology import choose
from knitjax.runtime import colocated
from knitjax.runtime.metrics import read_metrics
from lab.bench.report import format_table, write_json


def _time_knitjax(config, run_config, run_dir: str) -> dict:
  shutil.rmtree(run_dir, ignore_errors=True)  # always a fresh run: no resume
  colocated.run(run_config, run_dir, choose(run_config))
  return step_times(read_metrics(run_dir), config.warmup_steps, run_config.loop.steps)


def step_times(all_rows: list[dict], warmup_steps: int, steps: int) -> dict:
  """Medians over the steps after warm-up, end to end (``wall_s`` differences) and body."""
  rows = all_rows[warmup_steps:]
  if not rows:
    raise ValueError(f"loop.steps={steps} leaves no step after warmup_steps={warmup_steps}.")
  # wall_s counts from the start of this process's first step, so step k ends at wall_s[k] and
  # the time from the end of step k-1 to the end of step k is their difference.
  ends = np.array([0.0] + [r["wall_s"] for r in all_rows])
  wall_step_s = np.diff(ends)[warmup_steps:]
  step_s = np.array([r["step_s"] for r in rows])
  return {
    "wall_median_s": float(np.median(wall_step_s)),
    "wall_p90_s": float(np.percentile(wall_step_s, 90)),
    "median_s": float(np.median(step_s)),
    "p90_s": float(np.percentile(step_s, 90)),
    "rollout_median_s": float(np.median([r["rollout_s"] for r in rows])),
    "train_median_s": float(np.median([r["train_s"] for r in rows])),
    "timed_steps": len(rows),
  }


def _time_baseline(config, out: str) -> dict:
  """Runs the external baseline script in its own interpreter; returns its JSON."""
  python, script = config.baseline_python, config.baseline_script
  if not os.path.isfile(python):
    raise ValueError(f"baseline_python={python!r} is not a file (a venv's bin/python).")
  if not os.path.isfile(script):
    raise ValueError(f"baseline_script={script!r} is not a file.")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its own
  proc = subprocess.run(
    [python, script, "--out", out], env=env, capture_output=True, text=True, check=False
  )
  if proc.returncode != 0:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    raise ValueError(f"baseline {script} exited with {proc.returncode}: {tail[0]}")
  with open(out) as f:
    return json.load(f)


def run(config, workdir: str) -> dict:
  run_config = from_config_dict(config.run)
  baseline = bool(config.get("baseline_python", ""))
  rounds = int(config.get("rounds", 1))
  if rounds < 1:
    raise ValueError(f"rounds={rounds} must be >= 1.")
  os.makedirs(workdir, exist_ok=True)
  per_round = []
  for r in range(rounds):
    row = {"round": r}
    if baseline:
      base = _time_baseline(config, os.path.join(workdir, f"baseline_round{r}.json"))
      row["baseline_median_s"] = float(base["median_s"])
    knit = _time_knitjax(config, run_config, os.path.join(workdir, "step_time_run"))
    row.update(knit)
    if baseline:
      # Both end to end: Tunix's script times from the end of one step to the end of the next.
      row["ratio"] = row["baseline_median_s"] / row["wall_median_s"]
      row["ratio_step_s"] = row["baseline_median_s"] / row["median_s"]
    per_round.append(row)
    print(format_table([row], list(row)))

  m = run_config.model
  result = {
    # Headline: the median over rounds of each round's figure.
    **{k: float(np.median([row[k] for row in per_round])) for k in per_round[0] if k != "round"},
    "rounds": per_round,
    "sequences_per_step": run_config.admission.groups_per_step * run_config.rollout.group_size,
    "max_new_tokens": run_config.rollout.max_new_tokens,
    "shape": {
      "num_layers": m.num_layers,
      "d_model": m.d_model,
      "ffn_dim": m.ffn_dim,
      "num_heads": m.num_heads,
      "head_dim": m.head_dim,
      "num_kv_heads": m.num_kv_heads,
      "vocab_size": m.vocab_size,
    },
    "kl_coef": run_config.loss.kl_coef,
  }
  result["timed_steps"] = int(result["timed_steps"])
  if baseline:
    result["baseline"] = {"python": config.baseline_python, "script": config.baseline_script}
  write_json(workdir, "step_time", result)
  columns = [
    "wall_median_s",
    "median_s",
    "p90_s",
    "rollout_median_s",
    "train_median_s",
    "sequences_per_step",
  ]
  if baseline:
    columns += ["baseline_median_s", "ratio", "ratio_step_s"]
  print(format_table([result], columns))
  if baseline:
    ratios = ", ".join(f"{row['ratio']:.2f}" for row in per_round)
    print(
      f"knitjax is {result['ratio']:.2f}x faster than the baseline end to end (median; rounds: "
      f"{ratios}; step body alone: {result['ratio_step_s']:.2f}x)."
    )
  return result
