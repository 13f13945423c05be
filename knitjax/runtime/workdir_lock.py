"""One training run per workdir: ``WORKDIR/.lock``, held for the life of the run.

Two runs on one workdir would interleave their ``metrics.jsonl`` rows and overwrite each other's
checkpoints, so :func:`hold` refuses the second with one sentence naming the first (pid, host,
start time).

Local workdir: an exclusive ``fcntl.flock`` on ``.lock``, held through an open file for the life
of the process. The kernel drops it when the process dies however it dies (SIGKILL too), so a
dead run never holds a workdir. The file stays behind between runs; its text (owner pid, host,
start time) only feeds the message, the flock is the lock.

Cloud workdir (``gs://...``): object stores have no locks, so ``.lock`` is an object naming its
owner with a heartbeat, rewritten every ``ttl_s / 4`` seconds by a daemon thread; a lock whose
heartbeat is older than ``ttl_s`` belongs to a dead run and is taken over. Best effort: epath
offers no create-if-absent precondition, so two runs starting within the same second can both
write the object; the later write wins, and the other run's next heartbeat logs an error naming
the run that took it over.

Who takes it: the trainer's process 0 (``primary``); the other processes of a multi-process run
share its workdir by design, as do rollout hosts (``--role=rollout``) and readers such as
``knitjax.eval`` and ``knitjax.export``, which take no lock (reading a running run's newest
checkpoint is legitimate).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
import uuid

from absl import logging

from knitjax import workdir as wd

LOCK_FILE = ".lock"


class WorkdirInUse(ValueError):
  """Another live run holds the workdir."""


def _owner(token: str) -> dict:
  now = time.time()
  return {
    "pid": os.getpid(),
    "host": socket.gethostname(),
    "started": datetime.datetime.fromtimestamp(now, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
    "token": token,
    "heartbeat": now,
  }


def _refusal(workdir: str, owner: dict, extra: str = "") -> WorkdirInUse:
  who = (
    f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}, started "
    f"{owner.get('started', '?')}{extra}"
  )
  return WorkdirInUse(
    f"--workdir {workdir} is in use by another run ({who}); wait for it to end, stop it, or use "
    "another workdir."
  )


class _LocalLock:
  def __init__(self, workdir: str):
    import fcntl

    path = wd.path(workdir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      try:
        owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
      except ValueError:
        owner = {}
      os.close(fd)
      raise _refusal(workdir, owner) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_owner("")).encode(), 0)
    self._fd = fd

  def release(self) -> None:
    if self._fd is not None:
      os.close(self._fd)  # closing the last descriptor drops the flock
      self._fd = None


class _RemoteLock:
  def __init__(self, workdir: str, ttl_s: float):
    self._path, self._ttl_s, self._workdir = wd.path(workdir, LOCK_FILE), ttl_s, workdir
    self._token = uuid.uuid4().hex
    held = self._read()
    if held and time.time() - held.get("heartbeat", 0) < ttl_s:
      raise _refusal(workdir, held, self._age(held))
    self._owner = _owner(self._token)
    self._path.write_text(json.dumps(self._owner))
    if (self._read() or {}).get("token") != self._token:  # another run wrote it meanwhile
      raise _refusal(workdir, self._read() or {})
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._beat, name="knitjax-workdir-lock", daemon=True)
    self._thread.start()

  def _age(self, held: dict) -> str:
    age = time.time() - held.get("heartbeat", 0)
    return f"; heartbeat {age:.0f} s ago, taken over after {self._ttl_s:.0f} s without one"

  def _read(self) -> dict | None:
    try:
      return json.loads(self._path.read_text()) if self._path.exists() else None
    except ValueError:
      return None

  def _beat(self) -> None:
    while not self._stop.wait(self._ttl_s / 4):
      held = self._read()
      if held is not None and held.get("token") != self._token:
        logging.error("%s", _refusal(self._workdir, held))
        return
      self._owner["heartbeat"] = time.time()
      with contextlib.suppress(Exception):  # a failed heartbeat is retried at the next one
        self._path.write_text(json.dumps(self._owner))

  def release(self) -> None:
    if self._thread is None:
      return
    self._stop.set()
    self._thread.join()
    self._thread = None
    with contextlib.suppress(Exception):
      if (self._read() or {}).get("token") == self._token:
        self._path.unlink()


@contextlib.contextmanager
def hold(workdir: str, *, primary: bool = True, ttl_s: float = 120.0):
  """Holds ``workdir``'s lock for the ``with`` block (a no-op unless ``primary``).

  Raises:
    WorkdirInUse (a ValueError): another live run holds it; the sentence names that run.
  """
  if not primary:
    yield
    return
  wd.path(workdir).mkdir(parents=True, exist_ok=True)
  lock = _RemoteLock(workdir, ttl_s) if wd.is_remote(workdir) else _LocalLock(workdir)
  try:
    yield
  finally:
    lock.release()
