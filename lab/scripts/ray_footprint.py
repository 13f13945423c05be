"""What a local Ray costs: start seconds, processes and their memory, before and after one actor.

  python -m lab.scripts.ray_footprint [--rounds=3] [--out=/tmp/ray_footprint.json]

Each round starts Ray twice, each in a fresh Python process, alternating: ``old`` (the settings
before the lean start: token auth, no dashboard, no metrics) and ``lean`` (``ensure_ray`` as it
is, `knitjax.distributed.local_ray.local_init_kwargs`). Each process waits until the node is idle
(no process started or ended for 2 s, at least 5 s after ``ray.init``), sums the memory of every
process Ray started (the process's descendants: GCS server, raylet, agents, monitors, workers;
the driver is reported apart), starts one trivial actor, calls it, waits again and sums again;
then ``ray.shutdown()`` and checks that none of those processes is left. RSS counts shared pages
(Python's and Ray's libraries, mapped by every process) once per process; PSS divides them
among the processes that map them, so its sum is what the node costs the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from unittest import mock

import psutil

VARIANTS = ("old", "lean")
# ray.init's arguments before the lean start (commit 64493e2), for the "old" variant.
OLD_INIT_KWARGS = {
  "include_dashboard": False,
  "_system_config": {"enable_metrics_collection": False},
}


def _memory(pid: int) -> tuple[int, int]:
  """(RSS, PSS) in bytes from /proc; PSS is RSS where smaps_rollup cannot be read."""
  rss = psutil.Process(pid).memory_info().rss
  try:
    with open(f"/proc/{pid}/smaps_rollup") as f:
      pss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
  except (OSError, StopIteration):
    pss = rss
  return rss, pss


def _alive(p: psutil.Process) -> bool:
  try:
    return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


def _ray_processes() -> list[psutil.Process]:
  return [p for p in psutil.Process().children(recursive=True) if _alive(p)]


def _wait_idle(min_s: float = 5.0, still_s: float = 2.0, max_s: float = 30.0) -> float:
  """Waits until no Ray process started or ended for ``still_s`` (after ``min_s``); seconds."""
  t0 = time.monotonic()
  time.sleep(min_s)
  pids, since = None, time.monotonic()
  while time.monotonic() - t0 < max_s:
    now = {p.pid for p in _ray_processes()}
    if now != pids:
      pids, since = now, time.monotonic()
    elif time.monotonic() - since >= still_s:
      break
    time.sleep(0.5)
  return time.monotonic() - t0


def _name(p: psutil.Process) -> str:
  """The process name, or the script a plain ``python`` runs (monitor.py, dashboard.py, ...)."""
  name = p.name()
  if name.startswith("python"):
    scripts = [a for a in p.cmdline()[1:] if a.endswith(".py")]
    return os.path.basename(scripts[0]) if scripts else name
  return name


def _snapshot() -> dict:
  procs = []
  for p in _ray_processes():
    try:
      rss, pss = _memory(p.pid)
      procs.append({"pid": p.pid, "name": _name(p), "rss": rss, "pss": pss})
    except psutil.NoSuchProcess:
      pass
  driver_rss, driver_pss = _memory(os.getpid())
  return {
    "processes": len(procs),
    "rss_mib": sum(p["rss"] for p in procs) / 2**20,
    "pss_mib": sum(p["pss"] for p in procs) / 2**20,
    "driver_rss_mib": driver_rss / 2**20,
    "driver_pss_mib": driver_pss / 2**20,
    "per_process_mib": sorted(
      (p["name"], round(p["rss"] / 2**20), round(p["pss"] / 2**20)) for p in procs
    ),
  }


def measure(variant: str) -> dict:
  """Starts Ray as ``variant`` does in this process, measures it, shuts it down."""
  import ray

  from knitjax.distributed import local_ray

  old = mock.patch.object(local_ray, "local_init_kwargs", lambda: OLD_INIT_KWARGS)
  with old if variant == "old" else nullcontext():
    t0 = time.perf_counter()
    local_ray.ensure_ray("")
    init_s = time.perf_counter() - t0
  out = {"variant": variant, "init_s": init_s}
  out["idle_wait_s"] = _wait_idle()
  out["before"] = _snapshot()

  @ray.remote
  class Echo:
    def pid(self) -> int:
      return os.getpid()

  t0 = time.perf_counter()
  actor = Echo.remote()
  actor_pid = ray.get(actor.pid.remote(), timeout=60)
  out["first_actor_s"] = time.perf_counter() - t0
  out["actor_ran"] = actor_pid in {p.pid for p in _ray_processes()}
  _wait_idle()
  out["after_actor"] = _snapshot()

  started = _ray_processes()
  ray.shutdown()
  deadline = time.monotonic() + 15
  left = started
  while left and time.monotonic() < deadline:
    time.sleep(0.5)
    left = [p for p in started if _alive(p)]
  out["left_after_shutdown"] = [f"{p.pid} {p.name()}" for p in left]
  return out


def _row(r: dict, when: str) -> str:
  s = r[when]
  return (
    f"{r['round']:>5} {r['variant']:>4} {when:>11} {s['processes']:>5} {s['rss_mib']:>8.0f} "
    f"{s['pss_mib']:>8.0f} {s['driver_rss_mib']:>7.0f} {r['init_s']:>6.1f} "
    f"{r['first_actor_s']:>7.2f} {'yes' if r['actor_ran'] else 'NO':>5} "
    f"{len(r['left_after_shutdown']):>4}"
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default="/tmp/ray_footprint.json")
  parser.add_argument("--variant", choices=VARIANTS, help="measure one variant in this process")
  args = parser.parse_args()
  if args.variant:
    print(json.dumps(measure(args.variant)))
    return

  rows = []
  for rnd in range(1, args.rounds + 1):
    for variant in VARIANTS:
      proc = subprocess.run(
        [sys.executable, "-m", "lab.scripts.ray_footprint", f"--variant={variant}"],
        capture_output=True,
        text=True,
        timeout=300,
      )
      if proc.returncode:
        sys.exit(f"{variant} (round {rnd}) failed:\n{proc.stderr[-4000:]}")
      rows.append({"round": rnd, **json.loads(proc.stdout.strip().splitlines()[-1])})
      print(f"round {rnd} {variant}: done", file=sys.stderr)

  print("processes and MiB: Ray's processes (the driver's descendants), driver apart")
  print("round  ran        when procs  RSS MiB  PSS MiB drv RSS init s actor s   ran left")
  for r in rows:
    for when in ("before", "after_actor"):
      print(_row(r, when))
  print("median per variant (before the actor -> after it):")
  for variant in VARIANTS:
    mine = [r for r in rows if r["variant"] == variant]
    med = {
      (when, k): statistics.median(r[when][k] for r in mine)
      for when in ("before", "after_actor")
      for k in ("processes", "rss_mib", "pss_mib")
    }
    print(
      f"  {variant:>4}: {med['before', 'processes']:.0f} -> {med['after_actor', 'processes']:.0f} "
      f"processes, RSS {med['before', 'rss_mib']:.0f} -> {med['after_actor', 'rss_mib']:.0f} MiB, "
      f"PSS {med['before', 'pss_mib']:.0f} -> {med['after_actor', 'pss_mib']:.0f} MiB; "
      f"round 1 before (name, RSS, PSS): {mine[0]['before']['per_process_mib']}"
    )
  with open(args.out, "w") as f:
    json.dump({"command": "python -m lab.scripts.ray_footprint", "rows": rows}, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
