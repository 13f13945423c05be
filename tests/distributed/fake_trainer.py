"""A stand-in for `knitjax.main` under `knitjax.supervise` (tests/distributed/test_supervise.py).

Each process appends ``<attempt> <process_id> <num_processes>`` to ``WORKDIR/started`` and then
does what ``WORKDIR/plan`` says for its attempt (the count of ``start`` lines of process 0):
``kill1`` (process 1 SIGKILLs itself, the others exit 1 as survivors do), ``killall``, ``fail``
(every process exits 1) or ``ok`` (exit 0). Attempts past the plan's end are ``ok``.
"""

import os
import signal
import sys
import time


def main(argv: list[str]) -> int:
  flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
  workdir, k = flags["workdir"], int(flags.get("process_id", 0))
  n = int(flags.get("num_processes", 1))
  with open(os.path.join(workdir, "plan")) as f:
    plan = f.read().split()
  path = os.path.join(workdir, "started")
  with open(path, "a") as f:
    f.write(f"{k} {n}\n")
  time.sleep(0.3)  # every process of this attempt has written its line
  with open(path) as f:
    attempt = sum(line.split()[0] == "0" for line in f) - 1
  what = plan[attempt] if attempt < len(plan) else "ok"
  if what == "killall" or (what == "kill1" and k == 1):
    os.kill(os.getpid(), signal.SIGKILL)
  if what == "kill1":
    time.sleep(0.5)  # a survivor notices the loss and stops in one sentence
    print("error: trainer process 1 stopped; this one stops too.", file=sys.stderr)
    return 1
  return 1 if what == "fail" else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
