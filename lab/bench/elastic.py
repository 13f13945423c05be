"""Scaling the Ray rollout workers of a running run, 1 -> N -> 1 (configs/bench/elastic.py).

One disaggregated run (`knitjax.run.train`, in this process) with its rollout in Ray actors on a
local Ray; between train steps the bench asks the run for more and then fewer workers exactly as
``python -m knitjax.scale`` does (`knitjax.distributed.elastic.request`). After the run it checks,
from the run's own logs:

- ``quota_violations``: mini-batches (``consumed.jsonl``) whose class counts leave the
  per-mini-batch bounds or hold the wrong number of groups, plus train steps whose class counts
  differ from the quotas, plus what the admission index counted (``metrics.jsonl``);
- ``version_bound_violations``: groups that started beyond the depth bound
  (`knitjax.rollout.versions.start_limit` at their gen version, ``offered.jsonl``: every group of
  every step); ``arch_staleness_max`` and ``arch_staleness_over_bound`` (groups consumed more
  than ``M x pipeline.max_lag_steps`` versions after their colocated gap) beside it: the bound
  limits starts, and groups that several workers finish out of order can be consumed later;
- ``groups_lost`` / ``consumed_twice``: conservation by group id, offered = consumed + rejected +
  pending (the pending count of the last step), and no group id consumed (or offered) twice;
- ``seconds_to_first_group``: per new worker, seconds from the request to the offer of its first
  group, worst of them (goal: under 10 s); and steps/h in each phase.

Writes ``elastic.json`` and ``elastic.png`` (groups offered over time per worker, the requests
marked) and prints a table.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import os
import shutil
import time

import ml_collections as mc

from knitjax import workdir as wd
from knitjax.runtime.metrics import read_metrics
from lab.bench.report import format_table, write_json


def check_config(config: mc.ConfigDict) -> None:
  if config.workers < 2:
    raise ValueError(f"config.workers={config.workers} is not allowed; give 2 or more.")
  if config.train.topology.rollout_workers != 1:
    raise ValueError(
      "config.train.topology.rollout_workers must be 1: the bench scales 1 -> N -> 1."
    )
  if config.up_after + config.after_steps + 2 > config.train.loop.steps:
    raise ValueError(
      f"config.train.loop.steps={config.train.loop.steps} leaves no room for the phases; give at "
      f"least up_after + after_steps + 2 = {config.up_after + config.after_steps + 2}."
    )


@contextlib.contextmanager
def local_ray(cpus: int):
  """A local Ray as `knitjax.distributed.local_ray.ensure_ray` starts it without a run's token
  folder (the user's Ray token, as the Ray tests start it: Ray keeps the first token a process
  used), offering ``cpus`` CPUs: each rollout actor reserves one, and this machine may have fewer
  cores than the bench has actors."""
  import ray

  from knitjax.distributed import local_ray as lr

  if ray.is_initialized():
    ray.shutdown()
  try:
    lr.check_ray_token()
    lr.private_ray_token()
    ray.init(**lr.local_init_kwargs(), num_cpus=cpus)
    yield
  finally:
    ray.shutdown()


class _Schedule:
  """The ``on_step`` of the run: the requests for N workers and then for one, at their steps."""

  def __init__(self, config: mc.ConfigDict, workdir: str):
    from knitjax.distributed import elastic

    self._c, self._workdir, self._elastic = config, workdir, elastic
    self.requests: list[dict] = []  # {"workers", "t", "after_step"}
    self._all_working_at = None

  def _status(self) -> dict:
    return self._elastic.read_json(wd.path(self._workdir, self._elastic.STATUS)) or {}

  def _ask(self, workers: int, step: int) -> None:
    t = time.time()
    line = self._elastic.request(self._workdir, workers)
    self.requests.append({"workers": workers, "t": t, "after_step": step, "said": line})
    print(f"  after step {step}: {line}", flush=True)

  def __call__(self, step: int, metrics: dict) -> None:
    c, steps = self._c, self._c.train.loop.steps
    if step == c.up_after:
      self._ask(c.workers, step)
    if len(self.requests) != 1:
      return
    if self._all_working_at is None and len(self._status().get("working", [])) >= c.workers:
      self._all_working_at = time.time()
    held = self._all_working_at is not None and time.time() - self._all_working_at >= c.hold_s
    if held or step >= steps - c.after_steps:
      self._ask(1, step)


def _counts(config: mc.ConfigDict, consumed: list[dict], offered: list[dict], last: dict) -> dict:
  from knitjax.rollout import versions

  a, pipe = config.train.admission, config.train.pipeline
  m = a.minibatches
  b = sum(a.quotas.values())
  quota = 0
  per_step: dict[int, collections.Counter] = {}
  for mb in consumed:  # every mini-batch's bounds, then every step's quotas
    counts = collections.Counter(mb["classes"])
    per_step.setdefault(mb["step"], collections.Counter()).update(counts)
    low_high = [
      (a.min_per_minibatch.get(cls, 0), a.get("max_per_minibatch", {}).get(cls, b // m))
      for cls in a.quotas
    ]
    bad = any(not lo <= counts[cls] <= hi for cls, (lo, hi) in zip(a.quotas, low_high, strict=True))
    quota += bad or len(mb["classes"]) != b // m
  quota += sum(dict(c) != {k: q for k, q in a.quotas.items() if q} for c in per_step.values())
  quota += int(last.get("quota_violations", 0))

  lag = versions.lag_groups(pipe.max_lag_steps, groups_per_step=b, minibatches=m)
  offers = collections.Counter(o["group_id"] for o in offered)
  latest = {o["group_id"]: o for o in offered}
  accepted = sorted(g for g, o in latest.items() if not o["rejected"])
  bound = 0
  for rank, gid in enumerate(accepted):  # ids are handed out in start order
    limit = versions.start_limit(
      latest[gid]["gen_version"], groups_per_step=b, minibatches=m, lag_groups=lag,
      lag_unit=pipe.lag_unit,
    )  # fmt: skip
    bound += rank >= limit
  arch = [
    mb["consume_version"] - gen - mb["index"] for mb in consumed for gen in mb["gen_versions"]
  ]

  ids = [g for mb in consumed for g in mb["group_ids"]]
  consumed_ids = set(ids)
  rejected = {g for g, o in latest.items() if o["rejected"]}
  pending = int(last.get("groups_pending", 0))
  never_offered = len(consumed_ids - set(latest))
  lost = len(latest) - len(consumed_ids & set(latest)) - len(rejected) - pending
  return {
    "quota_violations": quota,
    "version_bound_violations": bound,
    "groups_lost": abs(lost) + never_offered + int(last.get("groups_lost", 0)),
    "consumed_twice": len(ids) - len(consumed_ids) + sum(n > 1 for n in offers.values()),
    # the bound limits starts; groups that finish out of order (on several workers) can still
    # be consumed later than M x max_lag_steps: reported, not counted as a violation
    "arch_staleness_max": max(arch, default=0),
    "arch_staleness_over_bound": sum(x > m * pipe.max_lag_steps for x in arch),
    "groups_offered": len(latest),
    "groups_consumed": len(consumed_ids),
    "groups_rejected": len(rejected),
    "groups_pending": pending,
  }


def _phases(rows: list[dict], requests: list[dict]) -> dict:
  """Steps/h in each phase: one worker, N workers (from the request for N to the one for one),
  one worker again; a phase's first step is its boundary (the first step of the run compiles)."""
  wall = {r["step"]: r["wall_s"] for r in rows}
  last = max(wall)
  edges = [1, *(r["after_step"] for r in requests), last]
  out = {}
  spans = zip(edges, edges[1:], strict=False)
  for name, (s0, s1) in zip(("before", "scaled", "after"), spans, strict=False):
    if s1 > s0:
      out[name] = {"steps": s1 - s0, "steps_per_hour": 3600 * (s1 - s0) / (wall[s1] - wall[s0])}
  return out


def run(config: mc.ConfigDict, workdir: str) -> dict:
  from knitjax.config import from_config_dict
  from knitjax.run import train

  check_config(config)
  run_dir = os.path.join(workdir, "run")
  shutil.rmtree(run_dir, ignore_errors=True)
  os.makedirs(run_dir)
  schedule = _Schedule(config, run_dir)
  t0 = time.time()
  with local_ray(cpus=config.workers):
    train(from_config_dict(copy.deepcopy(config.train)), run_dir, on_step=schedule)
  seconds = time.time() - t0
  rows = read_metrics(run_dir)
  consumed = wd.read_rows(wd.path(run_dir, "consumed.jsonl"))
  offered = wd.read_rows(wd.path(run_dir, "offered.jsonl"))
  up = schedule.requests[0] if schedule.requests else None
  firsts: dict[int, float] = {}
  per_unit = collections.Counter(o["storage_unit"] for o in offered)
  for o in offered:
    firsts.setdefault(o["storage_unit"], o["t_offer"])
  new = sorted(u for u in firsts if u != 0)  # unit 0 is the worker the run started with
  to_first = {u: firsts[u] - up["t"] for u in new} if up else {}
  with open(wd.path(run_dir, "rollout_workers.json")) as f:
    status = json.load(f)
  every_new = len(to_first) >= config.workers - 1
  out = {
    "seconds_to_first_group": max(to_first.values()) if every_new else None,
    **_counts(config, consumed, offered, rows[-1]),
    "seconds_to_first_group_per_worker": {str(u): s for u, s in to_first.items()},
    "groups_per_worker": {str(u): n for u, n in sorted(per_unit.items())},
    "new_workers_with_groups": len(to_first),
    "phases": _phases(rows, schedule.requests),
    "requests": schedule.requests,
    "workers_at_end": status.get("working"),
    "steps": len(rows),
    "seconds": seconds,
    "command": "python -m lab.bench --config configs/bench/elastic.py --workdir DIR",
    "config": config.to_dict(),
  }
  write_json(workdir, "elastic", out)
  _plot(workdir, offered, schedule.requests)
  print(
    format_table(
      [{"phase": k, **v} for k, v in out["phases"].items()], ["phase", "steps", "steps_per_hour"]
    )
  )
  keys = (
    "seconds_to_first_group", "quota_violations", "version_bound_violations", "groups_lost",
    "consumed_twice", "arch_staleness_max", "groups_per_worker", "workers_at_end",
  )  # fmt: skip
  print(format_table([{k: out[k] for k in keys}], keys))
  return out


def _plot(workdir: str, offered: list[dict], requests: list[dict]) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4))
  t0 = min((o["t_offer"] for o in offered), default=0.0)
  for unit in sorted({o["storage_unit"] for o in offered}):
    ts = sorted(o["t_offer"] - t0 for o in offered if o["storage_unit"] == unit)
    ax.step(ts, range(1, len(ts) + 1), where="post", label=f"worker {unit}")
  for r in requests:
    ax.axvline(r["t"] - t0, color="gray", linestyle="--")
    ax.annotate(f"-> {r['workers']}", (r["t"] - t0, 0), textcoords="offset points", xytext=(3, 3))
  ax.set_xlabel("seconds")
  ax.set_ylabel("groups offered")
  ax.set_title("Ray rollout workers scaled mid-run (dashed: requests)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "elastic.png"))
  plt.close(fig)
