"""A disaggregated trainer of 2 processes vs 1 (configs/bench/trainer_processes.py).

Each run is real (`knitjax.main`, the two-process one with ``--distributed`` on loopback,
`lab.local_processes`). Per variant: throughput and architectural staleness after the
warmup (`lab.bench.real_runs.measured_point`), and per published version the seconds from
dispatch until the rollout may adopt it and the bytes each trainer process put on the wire.
Writes ``trainer_processes.json`` and prints a table; docs/disaggregated.md has figures.
"""

from __future__ import annotations

import copy
import json
import os
import re

import ml_collections as mc
import numpy as np

from lab import local_processes
from lab.bench.real_runs import launch, measured_point, read_run
from lab.bench.report import format_table, write_json

VARIANTS = ("one", "two")


def _variant(config: mc.ConfigDict, variant: str) -> mc.ConfigDict:
  c = copy.deepcopy(config.train)
  c.loop.steps = config.steps
  c.pipeline.max_lag_steps = config.depth
  c.loop.log_every = max(1, config.steps // 4)
  c.admission.policy = "minibatch"
  c.checkpoint.every_steps = config.steps  # one save, at the end
  c.mesh.shape = (1, -1, 1)  # FSDP over the train devices (across both processes in ``two``)
  if variant == "one":
    c.mesh.cpu_devices, c.topology.rollout_devices = 8, 4  # 4 train + 4 staging devices
  else:
    c.mesh.cpu_devices = 2  # per process: one global train mesh of 4
  return c


def _summaries(errs: list[str]) -> list[dict]:
  out = []
  for k, err in enumerate(errs):
    found = re.findall(rf"process {k} of {len(errs)} finished: (\{{.*\}})", err)
    out.append(json.loads(found[-1]) if found else {})
  return out


def _run(cfg: mc.ConfigDict, root: str, name: str, variant: str) -> dict:
  if variant == "one":
    launched = launch(cfg, root, name)
    per_process = None
  else:
    workdir = os.path.join(root, "runs", name)
    path = os.path.join(root, "configs", f"{name}.py")
    launch(cfg, root, name, write_only=True)
    result = local_processes.launch([f"--config={path}"], workdir, [{}, {}], timeout=3600)
    if any(code for code, _ in result):
      tails = ["\n".join(err.splitlines()[-8:]) for _, err in result]
      raise RuntimeError(f"run {name!r} failed:\n" + "\n---\n".join(tails))
    per_process = [s.get("weight_publish_bytes") for s in _summaries([e for _, e in result])]
    launched = {"workdir": workdir, "command": f"2 x python -m knitjax.main --config {path} ..."}
  run = read_run(launched["workdir"])
  return {**launched, "run": run, "bytes_per_process": per_process}


def run(config: mc.ConfigDict, workdir: str) -> dict:
  os.makedirs(workdir, exist_ok=True)
  results: dict = {v: [] for v in VARIANTS}
  for rep in range(config.repeats):
    for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
      name = f"{variant}_r{rep}"
      r = _run(_variant(config, variant), workdir, name, variant)
      point = measured_point(r["run"], warmup_steps=config.warmup_steps, max_lag_steps=config.depth)
      window = r["run"]["rows"][config.warmup_steps :]
      point["weight_publish_s"] = float(np.mean([w["weight_publish_s"] for w in window]))
      point["weight_publish_bytes"] = float(np.mean([w["weight_publish_bytes"] for w in window]))
      point["bytes_per_process"] = r["bytes_per_process"]
      point["command"] = r["command"]
      results[variant].append(point)
      print(
        f"  {name}: {point['steps_per_hour']:.0f} steps/h, arch staleness "
        f"{point['arch_staleness_mean']:.3f}, publish {point['weight_publish_s']:.3f} s",
        flush=True,
      )
  keys = ("steps_per_hour", "arch_staleness_mean", "weight_publish_s", "weight_publish_bytes")
  mean = {v: {k: float(np.mean([p[k] for p in results[v]])) for k in keys} for v in VARIANTS}
  out = {
    "config": config.to_dict(),
    "runs": results,
    "mean": mean,
    "throughput_ratio_two_over_one": mean["two"]["steps_per_hour"] / mean["one"]["steps_per_hour"],
  }
  write_json(workdir, "trainer_processes", out)
  rows = [
    {
      "trainer processes": 1 if v == "one" else 2,
      **mean[v],
      "bytes per process": results[v][0]["bytes_per_process"] or [mean[v]["weight_publish_bytes"]],
    }
    for v in VARIANTS
  ]
  print(format_table(rows, ["trainer processes", *keys, "bytes per process"]))
  return out
