"""A supervisor: a trainer of several processes restarted on the processes left after a loss.

  python -m knitjax.supervise --processes=2 [--max_restarts=3] -- <the flags of knitjax.main>

It starts the ``--processes`` trainer processes of one ``--distributed`` run of `knitjax.main` on
this machine (coordinator on a free loopback port; one process runs without ``--distributed``)
and waits for them. A process killed by SIGKILL (``kill -9``, the kernel's OOM killer) is lost;
the supervisor kills the survivors at once (left alone they would stop by themselves, in one
sentence, once the lost one's pulse has been silent for 30 s:
`knitjax.distributed.coordination.PulseWatch`; see `wait`). It then starts the run again, same
flags, on
the processes left: it resumes from its newest checkpoint on another shape (fewer processes,
fewer devices; `knitjax.train.checkpoint` reshards on restore), with one log line per restart
and at most ``--max_restarts`` restarts. A run that stops without losing a process (a config
error, a full disk) is not restarted: its processes said why, and its exit code is returned.

Why a separate process and not a flag of `knitjax.main`: JAX's runtime cannot shrink a running
mesh or a ``jax.distributed`` job (a process lost is fatal to every collective, and process 0's
coordinator cannot admit a smaller job), so recovery means new processes, and whatever starts
them must outlive the old ones and must not itself join JAX's runtime. It is one machine's
supervisor: on a cluster the scheduler (Slurm, Kubernetes, a TPU pod's) plays this part with the
same rule (rerun the same command on the nodes left).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

MAIN = "knitjax.main"
GRACE_S = 120.0  # how long the others get to stop by themselves after a failure that is no loss


def _log(line: str) -> None:
  stamp = time.strftime("%H:%M:%S")
  print(f"{stamp} knitjax.supervise: {line}", file=sys.stderr, flush=True)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _workdir(args: list[str]) -> str:
  for i, a in enumerate(args):
    if a.startswith("--workdir="):
      return a.split("=", 1)[1]
    if a == "--workdir" and i + 1 < len(args):
      return args[i + 1]
  return ""


def _checkpoints(workdir: str) -> list[int]:
  folder = os.path.join(workdir, "checkpoints")
  if not workdir or not os.path.isdir(folder):
    return []
  return sorted(int(n) for n in os.listdir(folder) if n.isdigit())


def start(args: list[str], processes: int, module: str = MAIN) -> list[subprocess.Popen]:
  """Starts one run of ``python -m MODULE ARGS`` as ``processes`` processes on this machine."""
  cmd = [sys.executable, "-m", module, *args]
  if processes == 1:
    return [subprocess.Popen(cmd)]
  address = f"127.0.0.1:{_free_port()}"
  cmd += ["--distributed", f"--coordinator_address={address}", f"--num_processes={processes}"]
  return [subprocess.Popen([*cmd, f"--process_id={k}"]) for k in range(processes)]


def wait(procs: list[subprocess.Popen], grace_s: float = GRACE_S) -> tuple[list[int], set[int]]:
  """Every process's exit code, and the indices of those the supervisor killed.

  Once one is lost (SIGKILL), the others are killed at once: they cannot take another step (the
  mesh lost a process), a kill anywhere is survived (the run resumes from its checkpoint), and
  left alone they would stop only once the lost one's pulse has been silent for 30 s (SIGTERM
  does not help: a survivor is blocked in the collective the loss broke, or in orbax's wait for
  a save that needs the lost process, and orbax logs the interrupted wait with a stack trace).
  Once one fails otherwise, the others get ``grace_s`` to stop by themselves (they do, in one
  sentence); past it they are killed.
  """
  deadline, ours = None, set()
  while True:
    codes = [p.poll() for p in procs]
    if all(c is not None for c in codes):
      return codes, ours
    now = time.monotonic()
    lost = any(c == -signal.SIGKILL for k, c in enumerate(codes) if k not in ours)
    if deadline is None and any(c not in (None, 0) for c in codes):
      deadline = now + grace_s
    if lost or (deadline is not None and now > deadline):
      for k, p in enumerate(procs):
        if p.poll() is None:
          ours.add(k)
          p.kill()
    time.sleep(0.1)


def supervise(args: list[str], processes: int, *, max_restarts: int = 3, module: str = MAIN) -> int:
  """Runs the trainer (``python -m MODULE ARGS``: `knitjax.main` or an entry point that wraps
  it, such as ``lab.batch_dump``), restarting it on the processes left after each loss; returns
  its exit code."""
  workdir, restarts = _workdir(args), 0
  while True:
    procs = start(args, processes, module)
    try:
      codes, ours = wait(procs)
    except BaseException:  # Ctrl-C or SIGTERM of the supervisor: the trainer stops with it
      for p in procs:
        with contextlib.suppress(ProcessLookupError):
          p.send_signal(signal.SIGTERM)
      for p in procs:
        p.wait()
      raise
    if all(c == 0 for c in codes):
      return 0
    lost = [k for k, c in enumerate(codes) if c == -signal.SIGKILL and k not in ours]
    if not lost:  # stopped without a loss: the processes said why; rerunning would not help
      return next(c for c in codes if c != 0) if all(c >= 0 for c in codes) else 1
    left = max(1, processes - len(lost))
    if restarts >= max_restarts:
      _log(
        f"trainer process {', '.join(map(str, lost))} lost (SIGKILL) and {restarts} restarts "
        f"done of --max_restarts={max_restarts}: giving up; rerun to resume."
      )
      return 1
    restarts += 1
    steps = _checkpoints(workdir)
    then = f"checkpoint {steps[-1]}" if steps else "the start (no checkpoint yet)"
    _log(
      f"restart {restarts} of at most {max_restarts}: trainer process "
      f"{', '.join(map(str, lost))} of {processes} lost (SIGKILL); resuming from {then} on "
      f"{left} process{'es' if left != 1 else ''}."
    )
    processes = left


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m knitjax.supervise",
    description="Restart a multi-process knitjax run on the processes left after one is lost.",
    usage="%(prog)s --processes=N [--max_restarts=R] -- <flags of knitjax.main>",
  )
  parser.add_argument("--processes", type=int, required=True, help="trainer processes to start")
  parser.add_argument("--max_restarts", type=int, default=3, help="restarts before giving up")
  argv = sys.argv[1:] if argv is None else argv
  ours, sep, theirs = (
    (argv[: argv.index("--")], "--", argv[argv.index("--") + 1 :])
    if ("--" in argv)
    else (argv, "", [])
  )
  opts = parser.parse_args(ours)
  if not sep or not _workdir(theirs):
    parser.error("give the flags of knitjax.main after --, --workdir among them.")
  if opts.processes < 1 or opts.max_restarts < 0:
    parser.error(
      f"--processes={opts.processes} and --max_restarts={opts.max_restarts}: give 1 or more "
      "processes and 0 or more restarts."
    )
  if any(
    a.startswith(("--distributed", "--num_processes", "--process_id", "--coordinator"))
    for a in theirs
  ):
    parser.error(
      "--distributed, --coordinator_address, --num_processes and --process_id are the "
      "supervisor's to set."
    )
  try:
    return supervise(theirs, opts.processes, max_restarts=opts.max_restarts)
  except KeyboardInterrupt:
    return 130


if __name__ == "__main__":
  signal.signal(signal.SIGTERM, signal.default_int_handler)  # a KeyboardInterrupt: children stop
  sys.exit(main())
