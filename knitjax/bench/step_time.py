"""Step-time benchmark: median seconds per full colocated GRPO step.

It runs the real training loop (:func:`knitjax.runtime.colocated.run`) and
reads each step's wall time from ``metrics.jsonl``, so what is timed is what a
user runs: sampling, rewards, storage, admission, batch assembly and the
jitted update (with a reference forward when ``kl_coef > 0``).
"""

from __future__ import annotations

import os
import shutil

import numpy as np

from knitjax.bench.report import format_table, write_json
from knitjax.config import from_config_dict
from knitjax.runtime import colocated
from knitjax.runtime.metrics import read_metrics


def run(config, workdir: str) -> dict:
  run_config = from_config_dict(config.run)
  run_dir = os.path.join(workdir, "step_time_run")
  shutil.rmtree(run_dir, ignore_errors=True)  # always a fresh run: no resume
  colocated.run(run_config, run_dir)
  rows = read_metrics(run_dir)[config.warmup_steps :]
  if not rows:
    raise ValueError(
      f"runtime.steps={run_config.runtime.steps} leaves no step after warmup_steps="
      f"{config.warmup_steps}."
    )
  step_s = np.array([r["step_s"] for r in rows])
  rollout_s = np.array([r["rollout_s"] for r in rows])
  train_s = np.array([r["train_s"] for r in rows])
  m = run_config.model
  result = {
    "median_s": float(np.median(step_s)),
    "p90_s": float(np.percentile(step_s, 90)),
    "rollout_median_s": float(np.median(rollout_s)),
    "train_median_s": float(np.median(train_s)),
    "timed_steps": len(rows),
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
    "kl_coef": run_config.train.kl_coef,
  }
  write_json(workdir, "step_time", result)
  print(
    format_table(
      [result],
      [
        "median_s",
        "p90_s",
        "rollout_median_s",
        "train_median_s",
        "timed_steps",
        "sequences_per_step",
      ],
    )
  )
  return result
