"""Part of the fault suite: faults across the processes of one run (issue 47's classes).

Each case starts real `knitjax.main` processes on this machine, each in a session of its own, so
that whatever it leaves is killed when the case ends, however it ends: the process group (Ray's
own processes join their trainer's) and a running trainer's descendants (Ray's actors). Every
wait has a deadline.

- ``mismatch/<field>``: the two trainer processes of a ``--distributed`` run, process 1 started
  with another value of one config field; both must stop (non-zero exit) in one sentence naming
  the field.
- ``hostile_peer/second_coordinator``: while process 0 of a two-process run waits for its
  partner, a second run's process 0 on the same port must be refused in one sentence (exit 1).
- ``hostile_peer/garbage``: a raw TCP client sends garbage to the coordinator's port, once while
  process 0 waits and once while the run trains; the run must still finish (exit 0 on both).
- ``sigterm/one_process_ray``: SIGTERM to a one-process run with a Ray rollout actor after its
  first metrics row: exit 143 and ``stopped by SIGTERM after step N; ...`` as the last line.
- ``sigterm/process_1``: SIGTERM to process 1 of a two-process run with a Ray rollout actor
  after the first metrics row: process 1 exits 143 with that line, process 0 exits 1 with a
  sentence naming process 1, neither with a traceback; the same commands rerun then resume and
  finish (exit 0 on both) with the logs a disaggregated run must end with.

Start-up faults of ``--distributed`` are the ``entry_points`` part's ``main/distributed_*`` cases;
SIGKILL of a trainer process is the ``kill`` part's ``trainer_processes`` mode.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

from lab import REPO, local_processes
from lab.faults import entry_points, kill_resume

DEADLINE_S = 300.0  # a whole run; a refusal gets `REFUSAL_S`
REFUSAL_S = 120.0
# Two trainer processes of one device each, colocated: the smallest run of two processes.
TINY = ("configs/arith_tiny.py", "quick", {"mesh.cpu_devices": 1, "loop.steps": 2})
# Disaggregated with one Ray rollout actor (docs/reliability.md, Round 6 item 8, with 4 steps).
RAY = (
  "configs/arith_disagg.py",
  "quick",
  {"mesh.cpu_devices": 1, "topology.rollout_workers": 1, "loop.steps": 4},
)
MISMATCHES = {"seed": "1", "loop.steps": "3"}  # field of TINY -> process 1's value
TRACEBACK = "Traceback (most recent call last)"


class _Processes:
  """The processes a case starts; on exit each one's process group is killed."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.procs: list[subprocess.Popen] = []
    self.files: dict[int, str] = {}

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    import psutil

    left = []  # a running trainer's Ray actors, which put themselves in groups of their own
    for p in self.procs:
      with contextlib.suppress(psutil.Error):
        left += psutil.Process(p.pid).children(recursive=True) if p.poll() is None else []
    for p in self.procs:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
      p.wait()
    for child in left:
      with contextlib.suppress(psutil.Error):
        child.kill()

  def start(self, run, workdir: str, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "knitjax.main", *kill_resume._argv(run), f"--workdir={workdir}"]
    os.makedirs(self.workdir, exist_ok=True)
    path = os.path.join(self.workdir, f"stderr.{len(self.procs)}")
    with open(path, "w") as err:
      p = subprocess.Popen(
        [*cmd, *flags],
        cwd=REPO,
        env=local_processes._env({}),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=err,
        start_new_session=True,
      )
    self.procs.append(p)
    self.files[p.pid] = path
    return p

  def stderr(self, p: subprocess.Popen) -> str:
    with open(self.files[p.pid], errors="replace") as f:
      return f.read()

  def wait(self, procs, deadline: float) -> list[int | None]:
    """Exit codes of ``procs``; None for one still running at ``deadline`` (time.monotonic)."""
    codes = []
    for p in procs:
      try:
        codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
      except subprocess.TimeoutExpired:
        codes.append(None)
    return codes


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _distributed(port: int, k: int, n: int = 2) -> tuple[str, ...]:
  return (
    "--distributed",
    f"--coordinator_address=127.0.0.1:{port}",
    f"--num_processes={n}",
    f"--process_id={k}",
  )


def _rows(workdir: str) -> int:
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      return sum(1 for line in f if line.endswith("\n"))
  except OSError:
    return 0


def _wait_for(condition, deadline: float, procs=()) -> bool:
  """Polls ``condition()`` until it holds (True) or ``deadline`` passes or a process of
  ``procs`` exits (False)."""
  while time.monotonic() < deadline:
    if condition():
      return True
    if any(p.poll() is not None for p in procs):
      return False
    time.sleep(0.2)
  return False


def _outcome(codes, errs) -> str:
  lines = [kill_resume._last_line(e)[:300] for e in errs]
  return f"exit {', '.join(map(str, codes))}: " + " | ".join(repr(line) for line in lines)


def mismatch(workdir: str, field: str, value: str) -> tuple[list[str], str]:
  """Two trainer processes, process 1 with ``--config.FIELD=VALUE``."""
  port = _free_port()
  with _Processes(workdir) as ps:
    procs = [
      ps.start(TINY, os.path.join(workdir, "run"), *_distributed(port, k), *extra)
      for k, extra in enumerate(((), (f"--config.{field}={value}",)))
    ]
    codes = ps.wait(procs, time.monotonic() + REFUSAL_S)
    errs = [ps.stderr(p) for p in procs]
  problems = []
  for k, (code, err) in enumerate(zip(codes, errs, strict=True)):
    found = entry_points.classify(code, err, (f"config.{field}",))
    if found != ["rejected"]:
      problems.append(f"process {k}: {','.join(found)}: {kill_resume._last_line(err)[:200]}")
  return problems, _outcome(codes, errs)


def _garbage(port: int, seed: int) -> str | None:
  """Connects to ``127.0.0.1:port`` and sends 64 KiB of seeded bytes, after an HTTP/2 preface
  when ``seed`` is odd (what a gRPC server reads first); a problem, or None. The server closing
  or resetting the connection on the way is what it should do."""
  data = random.Random(seed).randbytes(1 << 16)
  if seed % 2:
    data = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + data
  try:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
  except OSError as e:
    return f"no connection to send the garbage on: {e}"
  with s, contextlib.suppress(OSError):
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    while s.recv(4096):
      pass
  return None


def _listening(port: int) -> bool:
  with socket.socket() as s:
    s.settimeout(1)
    return s.connect_ex(("127.0.0.1", port)) == 0


def hostile_peer(workdir: str) -> dict[str, tuple[list[str], str]]:
  """A two-process run with a second coordinator and garbage on its port (both cases)."""
  port = _free_port()
  run = os.path.join(workdir, "run")
  out = {}
  with _Processes(workdir) as ps:
    p0 = ps.start(TINY, run, *_distributed(port, 0))
    deadline = time.monotonic() + DEADLINE_S
    if not _wait_for(lambda: _listening(port), deadline, [p0]):
      err = kill_resume._last_line(ps.stderr(p0))[:200]
      problem = [f"process 0 never listened on port {port} (exit {p0.poll()}): {err}"]
      return {"second_coordinator": (problem, ""), "garbage": (problem, "")}
    # (a) a second run's process 0 on the same port
    second = kill_resume._argv(TINY) + [f"--workdir={os.path.join(workdir, 'second')}"]
    rc, err, seconds = entry_points.run_command(
      [sys.executable, "-m", "knitjax.main", *second, *_distributed(port, 0)],
      entry_points._env({}),
      REFUSAL_S,
      REPO,
    )
    found = entry_points.classify(rc, err, (f"127.0.0.1:{port}",))
    problems = [] if found == ["rejected"] and rc == 1 else [f"{','.join(found)} (exit {rc})"]
    last = kill_resume._last_line(err)[:300]
    out["second_coordinator"] = (problems, f"exit {rc} in {seconds:.0f} s: {last!r}")
    # (b) garbage while process 0 waits, then while the run trains
    problems = [p for p in [_garbage(port, 0), _garbage(port, 1)] if p]
    p1 = ps.start(TINY, run, *_distributed(port, 1))
    if _wait_for(lambda: _rows(run) >= 1, deadline, [p0, p1]):
      problems += [p for p in [_garbage(port, 2), _garbage(port, 3)] if p]
    else:
      problems.append("the run logged no step before it ended; garbage sent while waiting only")
    codes = ps.wait([p0, p1], deadline)
    errs = [ps.stderr(p0), ps.stderr(p1)]
  for k, (code, err) in enumerate(zip(codes, errs, strict=True)):
    if code != 0 or TRACEBACK in err:
      problems.append(f"process {k}: {_outcome([code], [err])}")
  steps = _rows(run)
  out["garbage"] = (
    problems,
    f"64 KiB twice while process 0 waited and twice after step 1; exit "
    f"{', '.join(map(str, codes))}, {steps} of {TINY[2]['loop.steps']} steps logged",
  )
  return out


def sigterm_one_process(workdir: str) -> tuple[list[str], str]:
  """SIGTERM to a one-process run with a Ray rollout actor after its first metrics row."""
  run = os.path.join(workdir, "run")
  with _Processes(workdir) as ps:
    p = ps.start(RAY, run)
    deadline = time.monotonic() + DEADLINE_S
    if not _wait_for(lambda: _rows(run) >= 1, deadline, [p]):
      [code] = ps.wait([p], time.monotonic())
      return [f"no step was logged (exit {code})"], _outcome([code], [ps.stderr(p)])
    p.send_signal(signal.SIGTERM)
    [code] = ps.wait([p], time.monotonic() + REFUSAL_S)
    err = ps.stderr(p)
  return _stopped_by_sigterm(code, err, "the run"), _outcome([code], [err])


def _stopped_by_sigterm(code: int | None, err: str, who: str) -> list[str]:
  last = kill_resume._last_line(err)
  problems = [] if code == 128 + signal.SIGTERM else [f"{who} exited {code}, not 143"]
  if not last.startswith("stopped by SIGTERM after step"):
    problems.append(f"{who}'s last line: {last[:200]!r}")
  if TRACEBACK in err:
    problems.append(f"{who} printed a traceback")
  return problems


def sigterm_process_1(workdir: str) -> tuple[list[str], str]:
  """SIGTERM to process 1 of a two-process run after the first metrics row; then a rerun."""
  port = _free_port()
  run = os.path.join(workdir, "run")
  steps = RAY[2]["loop.steps"]
  with _Processes(workdir) as ps:
    procs = [ps.start(RAY, run, *_distributed(port, k)) for k in (0, 1)]
    deadline = time.monotonic() + DEADLINE_S
    if not _wait_for(lambda: _rows(run) >= 1, deadline, procs):
      codes = ps.wait(procs, time.monotonic())
      errs = [ps.stderr(p) for p in procs]
      return [f"no step was logged (exits {codes})"], _outcome(codes, errs)
    procs[1].send_signal(signal.SIGTERM)
    codes = ps.wait(procs, time.monotonic() + REFUSAL_S)
    errs = [ps.stderr(p) for p in procs]
  problems = _stopped_by_sigterm(codes[1], errs[1], "process 1")
  if kill_resume._stopped_by(codes[0], errs[0]) != "pulse" or "process 1" not in errs[0]:
    problems.append(f"process 0: exit {codes[0]}, {kill_resume._last_line(errs[0])[:200]!r}")
  if TRACEBACK in errs[0]:
    problems.append("process 0 printed a traceback")
  outcome = _outcome(codes, errs)
  with _Processes(os.path.join(workdir, "rerun")) as ps:
    procs = [ps.start(RAY, run, *_distributed(port, k)) for k in (0, 1)]
    again = ps.wait(procs, time.monotonic() + DEADLINE_S)
    rerun_errs = [ps.stderr(p) for p in procs]
  if again != [0, 0]:
    problems.append(f"the rerun: {_outcome(again, rerun_errs)}")
  else:
    problems += kill_resume.check_disaggregated(run, steps, RAY)
  return problems, f"{outcome}; rerun exit {', '.join(map(str, again))}"


def cases() -> list[str]:
  """The names of the cases, in the order `run` runs them."""
  return [
    *(f"mismatch/{field}" for field in MISMATCHES),
    "hostile_peer/second_coordinator",
    "hostile_peer/garbage",
    "sigterm/one_process_ray",
    "sigterm/process_1",
  ]


def run(workdir: str, *, log=print) -> dict:
  """Runs every case; returns ``{"cases": {name: {"ok", "outcome", "problems", "seconds"}}}``."""
  workdir = os.path.abspath(workdir)
  shutil.rmtree(workdir, ignore_errors=True)
  results: dict[str, dict] = {}

  def record(name: str, found: tuple[list[str], str], seconds: float) -> None:
    problems, outcome = found
    results[name] = {
      "ok": not problems,
      "outcome": outcome,
      "problems": problems,
      "seconds": round(seconds, 1),
    }
    log(f"[processes] {name}: {problems or 'ok'} ({seconds:.0f} s)")

  for field, value in MISMATCHES.items():
    t0 = time.time()
    record(
      f"mismatch/{field}", mismatch(os.path.join(workdir, field), field, value), time.time() - t0
    )
  t0 = time.time()
  for name, found in hostile_peer(os.path.join(workdir, "hostile_peer")).items():
    record(f"hostile_peer/{name}", found, time.time() - t0)
  t0 = time.time()
  record(
    "sigterm/one_process_ray",
    sigterm_one_process(os.path.join(workdir, "sigterm1")),
    time.time() - t0,
  )
  t0 = time.time()
  record(
    "sigterm/process_1", sigterm_process_1(os.path.join(workdir, "sigterm2")), time.time() - t0
  )
  return {"cases": results}


def table_lines(result: dict) -> list[str]:
  """The fault suite's table rows of this part's result."""
  lines = []
  for name, c in result["cases"].items():
    verdict = "ok" if c["ok"] else "FAIL " + "; ".join(c["problems"])[:160]
    lines.append(f"processes      | {name}: {verdict}; {c['outcome'][:160]}")
  return lines
