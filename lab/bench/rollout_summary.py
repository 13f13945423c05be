"""Where did a disaggregated run's rollout time go? The engine's calls, stall and throughput of a
run, read from its ``metrics.jsonl`` and ``timings.json``.

  python -m lab.bench.rollout_summary DIR [DIR ...] [--warmup 4]

prints, per run, over the steps after ``warmup``: train steps per hour, mean architectural
staleness, engine calls and groups started (calls per group start), the group-start stall
fraction and its parts from the engine's call timeline (`knitjax.sim.calibration
.engine_timeline_fit`: host gaps while samples were held, device seconds, seconds per decode
pass), and the calibrated simulator's ``group_start_s``, ``report_delay_s``, and the trainer's
mini-batch seconds alone and extra while rollout runs (``trainer_alone_s``,
``trainer_contended_s``; `knitjax.sim.calibration.fit_costs`).
The figures of an A/B between two rollout settings come from this, one line per run.
"""

from __future__ import annotations

import sys

from knitjax.sim.calibration import fit_costs
from lab.bench.real_runs import measured_point, read_run

COLUMNS = (
  ("steps_per_hour", "steps/h", ".0f"),
  ("arch_staleness_mean", "arch", ".2f"),
  ("engine_calls", "calls", ".0f"),
  ("groups_started", "groups", ".0f"),
  ("calls_per_group", "calls/grp", ".2f"),
  ("group_start_stall_fraction", "stall", ".1%"),
  ("host_gap_s", "gaps s", ".2f"),
  ("device_s", "device s", ".2f"),
  ("decode_s_per_iteration", "s/pass", ".2e"),
  ("group_start_s", "start s", ".2e"),
  ("report_delay_s", "report s", ".2e"),
  ("trainer_alone_s", "train s", ".2e"),
  ("trainer_contended_s", "+contend", ".2e"),
)


def summarize(workdir: str, *, warmup_steps: int = 4) -> dict:
  """The figures of ``COLUMNS`` for the disaggregated run in ``workdir``.

  Raises:
    ValueError: the run has no engine timings (colocated, or not the continuous engine), or no
      steps after ``warmup_steps``.
  """
  run = read_run(workdir)
  t = run["timings"]
  if not t or not t.get("engine_calls"):
    raise ValueError(
      f"{workdir} has no engine call timeline in timings.json; accepted: a disaggregated run "
      "of the continuous engine."
    )
  point = measured_point(run, warmup_steps=warmup_steps, max_lag_steps=0.0)
  costs = fit_costs(run, warmup_steps=warmup_steps)
  out = {k: point[k] for k in ("steps_per_hour", "arch_staleness_mean")}
  out.update({k: costs[k] for k in ("groups_started", "group_start_stall_fraction")})
  out.update({k: costs[k] for k in ("host_gap_s", "device_s", "decode_s_per_iteration")})
  out["engine_calls"] = costs["timeline_calls"]
  out["calls_per_group"] = costs["timeline_calls"] / max(costs["groups_started"], 1)
  out.update(
    {
      k: costs[k]
      for k in ("group_start_s", "report_delay_s", "trainer_alone_s", "trainer_contended_s")
    }
  )
  return out


def table(rows: dict[str, dict]) -> str:
  """One line per run (its directory), the columns of ``COLUMNS``."""
  width = max(len(name) for name in rows)
  lines = [f"{'run':<{width}}" + "".join(f"{label:>11}" for _, label, _ in COLUMNS)]
  for name, row in rows.items():
    lines.append(f"{name:<{width}}" + "".join(f"{row[k]:>11{fmt}}" for k, _, fmt in COLUMNS))
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  warmup, dirs = 4, []
  args = iter(argv)
  for a in args:
    if a == "--warmup":
      warmup = int(next(args))
    else:
      dirs.append(a)
  if not dirs:
    raise SystemExit("usage: python -m lab.bench.rollout_summary DIR [DIR ...] [--warmup 4]")
  print(table({d: summarize(d, warmup_steps=warmup) for d in dirs}))


if __name__ == "__main__":
  main(sys.argv[1:])
