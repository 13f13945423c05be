"""Where a disaggregated run's staleness comes from, group by group, and where the calibrated
simulator parts from it: read from the run's ``offered.jsonl`` / ``consumed.jsonl`` wall times
and ``timings.json``.

  python -m lab.bench.group_times DIR [--config FILE] [--warmup 4]

prints, over the groups consumed after ``warmup`` steps, the mean of each part of a group's
staleness (consume version - gen version) in policy versions: ``label lag`` (the trainer's
version when the group started minus the version it started on), ``start->offer`` (versions
the trainer published while the group generated and until it was offered to admission) and
``offer->consume`` (versions until the update that used it); the seconds from start to offer per
class; the seconds from the publish that completes a step to the next group start; and the
trainer's mini-batch seconds alone and extra while groups generate (`knitjax.sim.calibration
.trainer_contention` on the groups' own generating spans). With ``--config`` (the run's config
file, e.g. the one a benchmark generated) the same parts from the simulator calibrated on the
run (`knitjax.sim.calibration`), one line below. A version is a trainer mini-batch end
(``trainer_minibatch_s``); a run resumed from a checkpoint restarts that record, so read runs
without restarts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np

from knitjax.config import from_config_dict
from knitjax.sim import calibration as cal
from knitjax.sim.engine import simulate
from lab.bench.real_runs import read_run
from lab.bench.staleness_real import prompt_tokens


def _jsonl(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _union(spans: np.ndarray) -> np.ndarray:
  out: list[list[float]] = []
  for a, b in spans[np.argsort(spans[:, 0])]:
    if out and a <= out[-1][1]:
      out[-1][1] = max(out[-1][1], b)
    else:
      out.append([a, b])
  return np.asarray(out, np.float64).reshape(-1, 2)


def measured(workdir: str, *, warmup_steps: int = 4) -> dict:
  """The parts of the groups' staleness in the run in ``workdir`` (module docstring).

  Raises:
    ValueError: the run's logs have no group wall times (recorded before they existed, or not a
      disaggregated run).
  """
  path = os.path.join(workdir, "offered.jsonl")
  offered = {o["group_id"]: o for o in _jsonl(path)} if os.path.exists(path) else {}
  if not offered or any(o.get("t_start") is None for o in offered.values()):
    raise ValueError(
      f"{workdir}/offered.jsonl has no group wall times (t_start); accepted: a disaggregated run "
      "recorded by this knitjax version or later."
    )
  run = read_run(workdir)
  mb = np.asarray(run["timings"]["trainer_minibatch_s"], np.float64).reshape(-1, 2)
  publish = np.sort(mb[:, 0])

  def version(t):
    return np.searchsorted(publish, t, side="right")

  label, gen, wait, by_class = [], [], [], {}
  for c in _jsonl(os.path.join(workdir, "consumed.jsonl")):
    if c["step"] < warmup_steps:
      continue
    for gid, g in zip(c["group_ids"], c["gen_versions"], strict=True):
      o = offered[gid]
      v_start, v_offer = version(o["t_start"]), version(o["t_offer"])
      label.append(v_start - g)
      gen.append(v_offer - v_start)
      wait.append(c["consume_version"] - v_offer)
      by_class.setdefault(o["cls"], []).append(o["t_offer"] - o["t_start"])
  t0 = cal.window_start(run, warmup_steps)
  m = _minibatches_per_step(run)
  step_publish = publish[m - 1 :: m]
  step_publish = step_publish[step_publish > t0]
  starts = np.sort([o["t_start"] for o in offered.values()])
  nxt = np.searchsorted(starts, step_publish)
  ok = nxt < len(starts)
  window = mb[mb[:, 0] > t0]
  spans = np.asarray([(o["t_start"], o["t_complete"]) for o in offered.values()], np.float64)
  alone, extra = cal.trainer_contention(window, _union(spans))
  return {
    "groups": len(label),
    "label_lag": float(np.mean(label)),
    "start_to_offer": float(np.mean(gen)),
    "offer_to_consume": float(np.mean(wait)),
    "start_to_offer_s": {k: float(np.mean(v)) for k, v in sorted(by_class.items())},
    "step_publish_to_start_s": float(np.mean(starts[nxt[ok]] - step_publish[ok])),
    "trainer_alone_s": alone,
    "trainer_contended_s": extra,
  }


def _minibatches_per_step(run: dict) -> int:
  """Versions per step: the version after the run's first step."""
  rows = run["rows"]
  return int(rows[0]["version"]) if rows else 1


def simulated(workdir: str, config_path: str, *, warmup_steps: int = 4, seeds=(0, 1, 2)) -> dict:
  """The same parts from the simulator calibrated on the run (per-run calibration, as the
  staleness benchmark does it), averaged over ``seeds``."""
  spec = importlib.util.spec_from_file_location("run_config", config_path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = from_config_dict(module.get_config())
  run = read_run(workdir)
  costs = cal.fit_costs(run, warmup_steps=warmup_steps)
  traces = cal.write_traces(run, workdir)
  w = cal.disaggregated_workload(cfg, costs, traces, prompt_tokens(cfg))
  p = cal.pipeline_of(cfg, colocated=False)
  steps = len(run["rows"])
  gen, wait, by_class = [], [], {}
  names = [c.name for c in w.classes]
  for seed in seeds:
    r = simulate(w, p, num_steps=steps, warmup_steps=warmup_steps, seed=seed)
    for gid, step, cv in zip(r.consumed_id, r.consumed_step, r.consume_version, strict=True):
      if step < warmup_steps:
        continue
      gen.append(r.version_complete[gid] - r.gen_version[gid])
      wait.append(cv - r.version_complete[gid])
      by_class.setdefault(names[r.cls[gid]], []).append(r.t_complete[gid] - r.t_start[gid])
  return {
    "groups": len(gen) // len(seeds),
    "label_lag": 0.0,  # the simulated rollout starts a group on the version it has at once
    "start_to_offer": float(np.mean(gen)),
    "offer_to_consume": float(np.mean(wait)),
    "start_to_offer_s": {k: float(np.mean(v)) for k, v in sorted(by_class.items())},
  }


def table(rows: dict[str, dict]) -> str:
  """One line per source (run or simulator)."""
  width = max(len(n) for n in rows)
  head = ["groups", "label lag", "start->offer", "offer->consume", "start->offer ms by class"]
  lines = [f"{'':<{width}}" + "".join(f"{h:>16}" for h in head[:4]) + "  " + head[4]]
  for name, r in rows.items():
    per = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["start_to_offer_s"].items())
    figures = (r["groups"], r["label_lag"], r["start_to_offer"], r["offer_to_consume"])
    lines.append(
      f"{name:<{width}}"
      + f"{figures[0]:>16d}"
      + "".join(f"{x:>16.2f}" for x in figures[1:])
      + "  "
      + per
    )
  for name, r in rows.items():
    if "trainer_alone_s" in r:
      lines.append(
        f"{name}: step publish -> next group start {r['step_publish_to_start_s'] * 1e3:.2f} ms; "
        f"trainer mini-batch {r['trainer_alone_s'] * 1e3:.2f} ms alone, "
        f"+{r['trainer_contended_s'] * 1e3:.2f} ms while groups generate"
      )
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  warmup, config, dirs = 4, None, []
  args = iter(argv)
  for a in args:
    if a == "--warmup":
      warmup = int(next(args))
    elif a == "--config":
      config = next(args)
    else:
      dirs.append(a)
  if len(dirs) != 1:
    raise SystemExit("usage: python -m lab.bench.group_times DIR [--config FILE] [--warmup 4]")
  rows = {dirs[0]: measured(dirs[0], warmup_steps=warmup)}
  if config:
    rows["simulator"] = simulated(dirs[0], config, warmup_steps=warmup)
  print(table(rows))


if __name__ == "__main__":
  main(sys.argv[1:])
