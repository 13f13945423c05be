"""``python -m lab.faults --workdir DIR``: the fault suite; writes ``DIR/faults.json``.

Parts (``--parts``): ``kill`` (SIGKILL at fault points and resume, both runtime modes; with
``--kill_modes`` also a resume on another shape, ``shape_2to1``, ``shape_1to2``,
``devices_2to4``, ``colocated_2to1``, and the supervisor's failover, ``supervised``), ``actors``
(a Ray storage unit and a rollout actor killed mid-run), ``inputs`` (generated bad inputs: configs
and their extremes, payloads, records, prompt files, checkpoints, hostile model folders),
``entry_points`` (every command fed a hostile command line), ``workdir`` (two runs on one workdir,
SIGINT / SIGTERM, SIGKILL during a resume, a full disk), ``backpressure`` (10x over-production
against the storage byte budget), and ``network`` (a link down, packet loss, a partition between
the trainer and the Ray node of its rollout actor, across an emulated cluster, and one of two Ray
nodes' hosts removed for good; ``--network_trials`` picks; needs root), and
``processes`` (faults across a run's processes: trainer processes started with different configs,
a second coordinator and garbage on the coordinator's port, SIGTERM to a process that joined Ray).
The ``entry_points`` and ``workdir`` parts mount (a read-only bind, a small tmpfs) when run as
root and skip those cases otherwise. See docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

from knitjax import cli
from lab import REPO

PARTS = (
  "kill",
  "actors",
  "inputs",
  "entry_points",
  "workdir",
  "backpressure",
  "network",
  "processes",
)

_WORKDIR = flags.DEFINE_string("workdir", None, "Scratch folder; faults.json is written here.")
_PARTS = flags.DEFINE_list("parts", list(PARTS), "Parts to run.")
_KILLS = flags.DEFINE_integer("kills", 10, "Kill-resume trials per runtime mode.")
_KILL_MODES = flags.DEFINE_list(
  "kill_modes",
  ["colocated", "disaggregated", "trainer_processes"],
  "Runtime modes of the kill-resume part (trainer_processes: two trainer processes and two Ray "
  "rollout actors; also shape_2to1, shape_1to2, devices_2to4, colocated_2to1: a resume on "
  "another shape; "
  "supervised: knitjax.supervise restarts a two-process run after a kill -9 of process 1).",
)
_EXAMPLES = flags.DEFINE_integer(
  "examples", 10_000, "Generated bad inputs (at least one per case of each kind is generated)."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of kill points and generated inputs.")
_NETWORK_TRIALS = flags.DEFINE_list(
  "network_trials",
  ["link_down", "loss", "partition", "node_removed"],
  "Trials of the network part (node_removed: one of two Ray nodes' hosts removed for good).",
)
flags.mark_flag_as_required("workdir")


def _table(results: dict) -> str:
  lines = ["part           | result"]
  if "kill" in results:
    for mode, r in results["kill"].items():
      lines.append(f"kill-resume    | {mode}: {r['ok']}/{len(r['trials'])} resumed correctly")
  if "actors" in results:
    r = results["actors"]
    n = sum(r["survived"].values())
    lines.append(f"Ray actor loss | {n}/{len(r['survived'])} kinds survived {r['problems'] or ''}")
  if "inputs" in results:
    r = results["inputs"]
    kinds = r["by_kind"].values()
    tb = sum(k["tracebacks"] for k in kinds)
    silent = sum(k["silent_accepts"] for k in kinds)
    lines.append(
      f"bad inputs     | {r['examples']} generated: {tb} tracebacks, {silent} silent accepts"
    )
  if "entry_points" in results:
    for entry, c in results["entry_points"]["by_entry"].items():
      lines.append(
        f"entry points   | {entry}: {c['cases']} cases, {c['rejected']} refused, "
        f"{c['tracebacks']} tracebacks, {c['silent_accepts']} silent accepts, {c['hangs']} hangs, "
        f"{c['data_losses']} data losses, {c['not_one_sentence'] + c['not_named']} unclear"
      )
  if "workdir" in results:
    for name, c in results["workdir"]["cases"].items():
      result = "skipped" if c["skipped"] else "ok" if c["ok"] else "; ".join(c["problems"])[:160]
      lines.append(f"workdir        | {name}: {result}")
  if "backpressure" in results:
    r = results["backpressure"]
    lines.append(
      f"backpressure   | budget held: {r['budget_held']} (peak {r['peak_bytes']} of "
      f"{r['max_bytes']} bytes), deadlock: {r['deadlock']}, peak RSS {r['peak_rss_mib']:.0f} MiB"
    )
  if "network" in results:
    r = results["network"]
    if "skipped" in r:
      lines.append(f"network        | skipped: {r['skipped']}")
    for name, t in r.get("trials", {}).items():
      result = "ok" if t["ok"] else "; ".join(t["problems"])[:160]
      lines.append(f"network        | {name}: {t['outcome']}, {result}")
      if "groups_lost" in t:
        lines.append(
          f"network        | {name}: {t['steps_finished']} steps, {t['groups_lost']} groups lost "
          f"({t['groups_lost_pending']} pending, {t['groups_lost_released']} released), "
          f"{t['groups_regenerated']} regenerated, next step "
          f"{t['removal_to_next_step_s'] or float('nan'):.1f} s after the removal"
        )
  if "processes" in results:
    from lab.faults import processes

    lines += processes.table_lines(results["processes"])
  return "\n".join(lines)


def check_flags() -> None:
  """Ends in ``error: <one sentence>`` (exit 1) for a flag no part could use, before any work:
  an empty --parts said it wrote faults.json and wrote nothing, --kills=-1 reported "0/0 resumed
  correctly", a negative --seed ended in an asyncio traceback, all with exit status 0."""
  from lab.faults import kill_resume

  if not _WORKDIR.value:
    sys.exit("error: --workdir is empty; give the scratch folder for faults.json.")
  if not _PARTS.value:
    sys.exit(f"error: --parts is empty; give one or more of {', '.join(PARTS)}.")
  if unknown := [p for p in _PARTS.value if p not in PARTS]:
    sys.exit(f"error: --parts {','.join(unknown)} not accepted; choose from {', '.join(PARTS)}.")
  if "kill" in _PARTS.value:
    modes = ", ".join(kill_resume.RUNS)
    if not _KILL_MODES.value:
      sys.exit(f"error: --kill_modes is empty; give one or more of {modes}.")
    if unknown := [m for m in _KILL_MODES.value if m not in kill_resume.RUNS]:
      sys.exit(f"error: --kill_modes {','.join(unknown)} not accepted; choose from {modes}.")
    if _KILLS.value < 1:
      sys.exit(f"error: --kills {_KILLS.value} is not accepted; give a count of at least 1.")
  if "network" in _PARTS.value:
    from lab.faults import network

    trials = _NETWORK_TRIALS.value
    if not trials or (unknown := [t for t in trials if t not in network.TRIALS]):
      given = ",".join(unknown) if trials else "(empty)"
      sys.exit(
        f"error: --network_trials {given} not accepted; choose from {', '.join(network.TRIALS)}."
      )
  if _EXAMPLES.value < 1:
    sys.exit(f"error: --examples {_EXAMPLES.value} is not accepted; give a count of at least 1.")
  if _SEED.value < 0:
    sys.exit(f"error: --seed {_SEED.value} is not accepted; give an integer of at least 0.")


def main(argv):
  del argv
  cli.quiet_libraries()
  check_flags()
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # the in-process runs (actor loss) use the shipped configs' 8 fake CPU devices
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
  workdir = os.path.abspath(_WORKDIR.value)
  os.makedirs(workdir, exist_ok=True)
  results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}
  path = os.path.join(workdir, "faults.json")

  def save():
    with open(path, "w") as f:
      json.dump(results, f, indent=1)

  for part in _PARTS.value:
    t0 = time.time()
    if part == "kill":
      from lab.faults import kill_resume

      results["kill"] = kill_resume.run(
        os.path.join(workdir, "kill"),
        kills=_KILLS.value,
        seed=_SEED.value,
        modes=tuple(_KILL_MODES.value),
      )
    elif part == "actors":
      from lab.faults import actor_loss

      results["actors"] = actor_loss.run(os.path.join(workdir, "actors"))
    elif part == "inputs":
      from lab.faults import bad_inputs

      results["inputs"] = bad_inputs.run(
        os.path.join(workdir, "inputs"), examples=_EXAMPLES.value, seed=_SEED.value
      )
    elif part == "entry_points":
      from lab.faults import entry_points

      results["entry_points"] = entry_points.run(os.path.join(workdir, "entry_points"), REPO)
    elif part == "workdir":
      from lab.faults import workdir_faults

      results["workdir"] = workdir_faults.run(os.path.join(workdir, "workdir"))
    elif part == "backpressure":
      from lab.faults import backpressure

      results["backpressure"] = backpressure.run()
    elif part == "network":
      from lab.faults import network

      results["network"] = network.run(
        os.path.join(workdir, "network"), trials=tuple(_NETWORK_TRIALS.value)
      )
    elif part == "processes":
      from lab.faults import processes

      results["processes"] = processes.run(os.path.join(workdir, "processes"))
    results.setdefault("seconds", {})[part] = time.time() - t0
    save()
  print(_table(results))
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
