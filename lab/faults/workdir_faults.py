"""Part of the fault suite: what happens to a run's workdir when the user or the machine interferes.

Each case is a small colocated run (`kill_resume.RUNS["colocated"]`: deterministic, so a resumed
run must end with exactly the parameters of an uninterrupted one) disturbed one way:

- ``two_runs``: two runs start together on one workdir; one must refuse in one sentence naming
  the other (its pid), and the other must end as if alone;
- ``sigint`` / ``sigterm``: Ctrl-C or a polite kill once a checkpoint exists; the run must stop
  with one line (no traceback), and the same command then resumes exactly;
- ``kill_during_resume``: SIGKILL at the start of a resume (the first rollout after the restore,
  when ``metrics.jsonl`` has just been cut back to the checkpoint); the next resume must keep the
  metrics history and end exactly;
- ``disk_full`` (root only: a tmpfs the case mounts and unmounts): the workdir's filesystem fills
  up during a checkpoint write; the run must stop with one sentence naming the path, leave no
  half-written checkpoint as the newest, and resume exactly once space is freed (the tmpfs grows);
  a resume on the still-full disk must stop with one sentence too;
- ``torn/<log>``: a finished 2-step ``configs/arith_disagg.py:quick`` run (with an evaluation every
  step) copied, one append-only log of the copy given a torn last line (what a kill mid-write
  leaves), and resumed for one more step: it must finish (exit 0, step 3 logged, no traceback)
  and leave every log whole. One case per log (``consumed.jsonl``, ``offered.jsonl``,
  ``metrics.jsonl``, ``eval.jsonl``); ``fetched.p0.jsonl`` is written only by a run of several
  trainer processes, so its case is skipped where the run wrote none.

Outcomes per case: ``ok``, or the problems found (``traceback``, ``silent_accept``, ``hang``,
``data_loss``, ``unclear``), each with the line that shows it.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from lab.faults import entry_points, kill_resume

RUN = kill_resume.RUNS["colocated"]
STEPS = RUN[2]["loop.steps"]
TIMEOUT_S = 600.0
PROBLEMS = ("traceback", "silent_accept", "hang", "data_loss", "unclear")


def _start(workdir: str, env: dict | None = None) -> subprocess.Popen:
  cmd = [sys.executable, "-m", "knitjax.main", *kill_resume._argv(RUN), f"--workdir={workdir}"]
  return subprocess.Popen(
    cmd,
    cwd=kill_resume.REPO,
    env=kill_resume._env(env or {}),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
    errors="replace",
    start_new_session=True,
  )


def _finish(proc: subprocess.Popen, timeout_s: float = TIMEOUT_S) -> tuple[int | None, str]:
  try:
    _, err = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.communicate()
    return None, err
  return proc.returncode, err


def _last_line(err: str) -> str:
  lines = [line for line in err.strip().splitlines() if line.strip()]
  return lines[-1] if lines else ""


def _refusal(rc: int | None, err: str, names: tuple[str, ...]) -> list[str]:
  """Problems of a command that must stop with one sentence naming one of ``names``."""
  if rc is None:
    return ["hang"]
  if "Traceback (most recent call last)" in err:
    return [f"traceback: {_last_line(err)[:300]}"]
  if rc == 0:
    return ["silent_accept"]
  last = _last_line(err)
  if not last.startswith("error:") or not any(n in last for n in names):
    return [f"unclear: {last[:300]}"]
  return []


def _ended_exactly(workdir: str, reference: str) -> list[str]:
  return [f"data_loss: {p}" for p in kill_resume.check_colocated(workdir, reference, RUN, STEPS)]


def _checkpoints(workdir: str) -> list[int]:
  folder = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []


def _wait_for_checkpoint(proc: subprocess.Popen, workdir: str, step: int) -> bool:
  deadline = time.monotonic() + TIMEOUT_S
  while time.monotonic() < deadline and proc.poll() is None:
    if any(s >= step for s in _checkpoints(workdir)):
      return True
    time.sleep(0.2)
  return False


def _resume(workdir: str, reference: str, env: dict | None = None) -> list[str]:
  rc, err = _finish(_start(workdir, env))
  if rc != 0:
    return [f"data_loss: the resume failed (exit {rc}): {_last_line(err)[:300]}"]
  return _ended_exactly(workdir, reference)


def two_runs(workdir: str, reference: str) -> list[str]:
  """Two runs started together on one workdir: one trains, the other is refused naming it."""
  runs = [_start(workdir), _start(workdir)]
  ended = [_finish(p) for p in runs]
  refused = [i for i, (rc, _) in enumerate(ended) if rc != 0]
  if len(refused) != 1:
    tails = [_last_line(err)[:200] for _, err in ended]
    return [f"silent_accept: {2 - len(refused)} of 2 runs trained on one workdir {tails}"]
  loser, winner = refused[0], 1 - refused[0]
  rc, err = ended[loser]
  problems = _refusal(rc, err, (str(runs[winner].pid),))
  return problems + _ended_exactly(workdir, reference)


def _signal(sig: int) -> Callable[[str, str], list[str]]:
  def case(workdir: str, reference: str) -> list[str]:
    proc = _start(workdir)
    if not _wait_for_checkpoint(proc, workdir, 2):
      _finish(proc)
      return ["hang: the run wrote no second checkpoint"]
    proc.send_signal(sig)
    rc, err = _finish(proc, timeout_s=120)
    problems = []
    if rc is None:
      problems.append("hang")
    elif "Traceback (most recent call last)" in err:
      problems.append(f"traceback: {_last_line(err)[:300]}")
    elif rc == 0 and len(_checkpoints(workdir)) and max(_checkpoints(workdir)) < STEPS:
      problems.append("silent_accept: exit 0 before the last step")
    elif rc != 0 and not _last_line(err).startswith(("error:", "stopped by")):
      problems.append(f"unclear: {_last_line(err)[:300]}")
    return problems + _resume(workdir, reference)

  return case


def kill_during_resume(workdir: str, reference: str) -> list[str]:
  rc, err = _finish(_start(workdir, {"KNITJAX_KILL_AT": "checkpoint:3"}))
  if rc != -signal.SIGKILL:
    return [f"unclear: the first run was not killed (exit {rc}): {_last_line(err)[:300]}"]
  rc, err = _finish(_start(workdir, {"KNITJAX_KILL_AT": "rollout:1"}))
  if rc != -signal.SIGKILL:
    return [f"unclear: the resume was not killed (exit {rc}): {_last_line(err)[:300]}"]
  return _resume(workdir, reference)


def _tmpfs(path: str, size: int) -> bool:
  os.makedirs(path, exist_ok=True)
  if os.geteuid() != 0 or not shutil.which("mount"):
    return False
  cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "knitjax-faults", path]
  return subprocess.run(cmd, capture_output=True).returncode == 0


def _du(path: str) -> int:
  return sum(
    os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
  )


def disk_full(workdir: str, reference: str) -> list[str]:
  """The workdir on a tmpfs with room for everything but the checkpoints and one and a half
  checkpoints: the first fits, the second (the first is still kept) does not."""
  checkpoints = _du(os.path.join(reference, "checkpoints"))
  per_checkpoint = checkpoints // max(1, len(_checkpoints(reference)))
  size = _du(reference) - checkpoints + 3 * per_checkpoint // 2
  if not _tmpfs(workdir, size):
    return ["skipped: no tmpfs mount (needs root and mount)"]
  try:
    rc, err = _finish(_start(workdir))
    problems = _refusal(rc, err, ("space", "ENOSPC", workdir))
    newest = _checkpoints(workdir)
    # still full: a resume must refuse the same way (it may first clear what it can)
    rc, err = _finish(_start(workdir))
    if rc != 0:
      problems += _refusal(rc, err, ("space", "ENOSPC", workdir))
    grow = ["mount", "-o", f"remount,size={_du(reference) * 4}", workdir]
    subprocess.run(grow, check=True, capture_output=True)
    problems += _resume(workdir, reference)
    if not newest:
      problems.append("unclear: no checkpoint fitted, the case tested nothing")
    return problems
  finally:
    subprocess.run(["umount", "-l", workdir], capture_output=True)


# The torn-log cases' run: disaggregated, so that it writes the pipeline's logs, and evaluating
# every step, so that it writes eval.jsonl.
TORN_RUN = (
  "configs/arith_disagg.py",
  "quick",
  {"loop.steps": 2, "eval.every_steps": 1, "eval.prompts": 16},
)
TORN_LOGS = ("consumed.jsonl", "offered.jsonl", "fetched.p0.jsonl", "metrics.jsonl", "eval.jsonl")
TORN_LINE = '{"step": 3, "group_ids": [4'  # a row cut mid-write: no closing brace, no newline


def _run_torn(workdir: str, steps: int) -> tuple[int | None, str]:
  path, variant, overrides = TORN_RUN
  run = (path, variant, {**overrides, "loop.steps": steps})
  cmd = [sys.executable, "-m", "knitjax.main", *kill_resume._argv(run), f"--workdir={workdir}"]
  proc = subprocess.Popen(
    cmd,
    cwd=kill_resume.REPO,
    env=kill_resume._env({}),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
    errors="replace",
    start_new_session=True,
  )
  return _finish(proc)


@functools.cache
def _finished_disaggregated(workdir: str) -> str | None:
  """A problem of the 2-step run of `TORN_RUN` made in ``workdir``, once per fault-suite run
  (None: it finished)."""
  shutil.rmtree(workdir, ignore_errors=True)
  rc, err = _run_torn(workdir, TORN_RUN[2]["loop.steps"])
  return None if rc == 0 else f"unclear: the run to tear failed (exit {rc}): {_last_line(err)}"


def _whole_rows(path: str) -> list[dict] | None:
  """Every row of a JSON-lines file, or None if a line of it is not a JSON object."""
  try:
    with open(path) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  except ValueError:
    return None
  return rows if all(isinstance(r, dict) for r in rows) else None


def _torn(log: str) -> Callable[[str, str], list[str]]:
  def case(workdir: str, reference: str) -> list[str]:
    del reference  # the colocated run writes none of the pipeline's logs
    finished = os.path.join(os.path.dirname(workdir), "finished")
    if problem := _finished_disaggregated(finished):
      return [problem[:300]]
    if not os.path.exists(os.path.join(finished, log)):
      return [f"skipped: a one-process run writes no {log}"]
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.copytree(finished, workdir)
    with open(os.path.join(workdir, log), "a") as f:
      f.write(TORN_LINE)
    steps = TORN_RUN[2]["loop.steps"] + 1
    rc, err = _run_torn(workdir, steps)
    if rc is None:
      return ["hang"]
    if "Traceback (most recent call last)" in err:
      return [f"traceback: {_last_line(err)[:300]}"]
    if rc != 0:
      return [f"data_loss: the resume failed (exit {rc}): {_last_line(err)[:300]}"]
    problems = []
    rows = _whole_rows(os.path.join(workdir, "metrics.jsonl")) or []
    if [r.get("step") for r in rows] != list(range(1, steps + 1)):
      problems.append(f"data_loss: metrics steps {[r.get('step') for r in rows]}")
    for name in TORN_LOGS:
      path = os.path.join(workdir, name)
      if os.path.exists(path) and _whole_rows(path) is None:
        problems.append(f"data_loss: {name} still holds a line that is not a JSON object")
    return problems

  return case


CASES = {
  "two_runs": two_runs,
  "sigint": _signal(signal.SIGINT),
  "sigterm": _signal(signal.SIGTERM),
  "kill_during_resume": kill_during_resume,
  "disk_full": disk_full,
  **{f"torn/{log}": _torn(log) for log in TORN_LOGS},
}


def run(workdir: str, *, log=print) -> dict:
  """Runs every case after one uninterrupted reference run; returns each case's problems."""
  workdir = os.path.abspath(workdir)
  entry_points.clear_mounts(workdir)  # a killed earlier run's tmpfs
  shutil.rmtree(workdir, ignore_errors=True)
  reference = os.path.join(workdir, "reference")
  rc, err = _finish(_start(reference))
  if rc != 0:
    raise RuntimeError(f"the reference run failed (exit {rc}): {err[-2000:]}")
  cases = {}
  for name, case in CASES.items():
    t0 = time.time()
    problems = case(os.path.join(workdir, name), reference)
    skipped = [p for p in problems if p.startswith("skipped")]
    cases[name] = {
      "ok": not problems,
      "skipped": bool(skipped),
      "problems": problems,
      "seconds": round(time.time() - t0, 1),
    }
    log(f"[workdir] {name}: {problems or 'ok'} ({time.time() - t0:.0f} s)")
  counts = dict.fromkeys(PROBLEMS, 0)
  for c in cases.values():
    for p in c["problems"]:
      kind = p.split(":")[0]
      if kind in counts:
        counts[kind] += 1
  return {"cases": cases, "counts": counts}
