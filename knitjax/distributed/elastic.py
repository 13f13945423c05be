"""Scaling the Ray rollout workers of a running run: a request file in the workdir.

``python -m knitjax.scale --workdir W --rollout_workers N`` (`request`) writes
``W/scale_request.json`` whole or not at all; the trainer's :class:`ScaleWatch` looks at it
between train steps (one ``stat``) and hands a new count to the rollout
(`knitjax.distributed.ray_rollout.RayRollout.scale`), which starts or retires actors without
stopping the run. The run keeps ``W/rollout_workers.json`` up to date: the count asked for, the
workers working, joining and leaving, and the process that holds them; the command reads it to
refuse a workdir whose run has no Ray rollout workers.

Why a file in the workdir: the workdir is already the run's one address (its lock, logs and
checkpoints; local or ``gs://``), so the command needs no port, no Ray connection, no token and
no knowledge of where the trainer runs, and the same command serves a run on one machine and
one whose rollout spans a Ray cluster. The request outlives the process: a run resumed on the
workdir starts with the count last asked for. Ray's autoscaler is not needed: it adds nodes for
actors that wait for resources, so with one, asking for more workers than the cluster holds
makes the new actors wait until the autoscaler brings nodes up, and the run goes on with those
it has meanwhile.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time

from absl import logging

from knitjax import workdir as wd

REQUEST = "scale_request.json"  # written by `request` (the user's command)
STATUS = "rollout_workers.json"  # written by the run (`ScaleWatch`)
LOCK = ".lock"  # `knitjax.runtime.workdir_lock.LOCK_FILE`: every run on a workdir holds it


def _write(file, text: str) -> None:
  if wd.is_remote(file):
    file.write_text(text)  # an object is replaced whole
  else:
    wd.replace_atomically(file, text)


def read_json(file) -> dict | None:
  """The JSON object in ``file``, or None when it is missing or not an object."""
  try:
    value = json.loads(file.read_text())
  except (FileNotFoundError, ValueError, OSError):
    return None
  return value if isinstance(value, dict) else None


def request(workdir: str, workers: int) -> str:
  """Asks the run in ``workdir`` for ``workers`` Ray rollout workers; returns what happens next.

  Raises:
    ValueError: (one sentence) ``workers`` < 1, no run in ``workdir``, or a run without Ray
      rollout workers (colocated, or disaggregated in one process).
  """
  if workers < 1:
    raise ValueError(f"--rollout_workers={workers} is not allowed; give 1 or more.")
  root = wd.path(workdir)
  if not root.is_dir() or not (root / LOCK).exists():
    raise ValueError(
      f"--workdir {workdir} holds no run (no {LOCK} file there); give the --workdir of a run "
      "started with python -m knitjax.main."
    )
  status = read_json(root / STATUS)
  if status is None:
    raise ValueError(
      f"the run in {workdir} has no Ray rollout workers to scale (only a disaggregated run with "
      "config.topology.rollout_workers > 0 and one trainer process has them), or it has not "
      "started them yet."
    )
  now = time.time()
  _write(
    root / REQUEST,
    json.dumps({"rollout_workers": int(workers), "requested_at": now, "by": socket.gethostname()}),
  )
  asked = status.get("rollout_workers")
  here = status.get("host") == socket.gethostname()
  if here and not wd.pid_alive(status.get("pid")):
    return (
      f"asked for {workers} Ray rollout workers; the run in {workdir} is not running now, so it "
      "starts with them when it resumes."
    )
  return (
    f"asked the run in {workdir} for {workers} Ray rollout workers (it had asked for {asked}); "
    f"it takes the request at its next train step (see {STATUS})."
  )


class ScaleWatch:
  """The run's side: the count in ``scale_request.json`` handed to ``rollout``, between steps.

  Args:
    workdir: the run's.
    rollout: a `knitjax.distributed.ray_rollout.RayRollout` (``scale``, ``members``).
    workers: the count the run starts with (``config.topology.rollout_workers``).
  """

  def __init__(self, workdir: str, rollout, workers: int):
    del workers  # the rollout's own count (``members()["asked"]``) is the one that holds
    self._request, self._status = wd.path(workdir, REQUEST), wd.path(workdir, STATUS)
    self._rollout, self._requested_at = rollout, None
    self._seen = None  # the request file's (mtime, size) last read
    self._members = None
    self._started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    self.poll()  # a request left by an earlier process of this run applies from the start
    self._write_status()

  def _key(self):
    if wd.is_remote(self._request):  # an object store has no cheap mtime through epath
      return self._request.read_text() if self._request.exists() else None
    try:
      st = os.stat(self._request)
    except FileNotFoundError:
      return None
    return st.st_mtime_ns, st.st_size, st.st_ino

  def poll(self) -> None:
    """Applies a new request, and records the workers when they changed (one stat when not)."""
    key = self._key()
    if key is not None and key != self._seen:
      self._seen = key
      self._apply(read_json(self._request))
    if self._rollout.members() != self._members:
      self._write_status()

  def _apply(self, req: dict | None) -> None:
    n = None if req is None else req.get("rollout_workers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
      logging.warning(
        "ignored %s: it does not hold {'rollout_workers': N} with N >= 1 (write it with "
        "python -m knitjax.scale).",
        self._request,
      )
      return
    self._requested_at = req.get("requested_at")
    asked = self._rollout.members()["asked"]
    if n == asked:
      return
    logging.info("scaling the Ray rollout workers from %d to %d (%s)", asked, n, REQUEST)
    self._rollout.scale(n)
    self._write_status()

  def _write_status(self) -> None:
    self._members = self._rollout.members()
    members = dict(self._members)
    status = {
      "rollout_workers": members.pop("asked"),
      **members,
      "requested_at": self._requested_at,
      "t": time.time(),
      "pid": os.getpid(),
      "host": socket.gethostname(),
      "started": self._started,
    }
    _write(self._status, json.dumps(status))
