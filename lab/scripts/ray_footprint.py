"""What a local Ray costs before its first actor: start seconds, processes and their memory.

  python -m lab.scripts.ray_footprint

Starts Ray as a knitjax run does (`knitjax.distributed.local_ray.ensure_ray`: token auth, no
dashboard, no metrics), waits 5 s for its daemons to settle, and sums the resident memory of
every process it started (this process's descendants). A rollout host (`--role=rollout`) starts
none: docs/disaggregated.md compares the two.
"""

import time

import psutil

from knitjax.distributed.local_ray import ensure_ray


def main() -> None:
  t0 = time.perf_counter()
  ensure_ray("")
  started = time.perf_counter() - t0
  time.sleep(5)
  kids = psutil.Process().children(recursive=True)
  rss = sum(p.memory_info().rss for p in kids)
  names = sorted({p.name() for p in kids})
  print(f"ray.init {started:.1f} s; {len(kids)} processes, {rss / 2**20:.0f} MiB resident: {names}")


if __name__ == "__main__":
  main()
