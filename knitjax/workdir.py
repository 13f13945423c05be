"""Where a run's files go: a local folder or a cloud URL such as ``gs://bucket/runs/a``.

Every path under the workdir (checkpoints, ``metrics.jsonl``, TensorBoard, plots, the pipeline
and evaluation logs) goes through :func:`path`, an ``etils.epath.Path``: the path library Orbax
uses, so checkpoints and everything else reach the same storage by the same route. A local
path is made absolute (Orbax needs that, and a run should not depend on a later ``chdir``); a URL
with a scheme is left as it is (``os.path.abspath("gs://b/x")`` would make it a local folder
``./gs:/b/x``). ``gs://`` needs ``gcsfs`` (epath's fsspec backend) and ``google-cloud-storage``
(Orbax lists and deletes steps with it): ``pip install -e '.[gcs]'``.

Object stores cannot append to an object, so :class:`JsonlFile` keeps an append-only JSON-lines
file in memory on a remote workdir and rewrites the whole object on ``flush``; an upload replaces
the object whole or not at all, so a kill mid-upload leaves the previous complete version.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil

from absl import logging
from etils import epath


def is_remote(workdir: str | os.PathLike) -> bool:
  """Whether ``workdir`` is a URL with a scheme (``gs://...``) rather than a local path."""
  return "://" in os.fspath(workdir)


def path(workdir: str | os.PathLike, *parts: str) -> epath.Path:
  """``workdir/parts...`` as an epath: absolute if local, the URL unchanged if remote."""
  root = os.fspath(workdir)
  if not is_remote(root):
    root = os.path.abspath(root)
  return epath.Path(root).joinpath(*parts)


def read_rows(p: epath.Path) -> list[dict]:
  """The rows of an append-only JSON-lines log (``metrics.jsonl``, ``eval.jsonl``,
  ``consumed.jsonl``, ...) less a torn last line, with a warning; [] when it does not exist.

  A kill mid-write leaves at most the last line torn (:class:`JsonlFile` appends a flush in one
  write, and a resume rewrites the rows it keeps), so a last line that is not a JSON object is
  dropped. A last line that parses but lost its newline is kept: an object does not parse
  before its closing brace is written, so nothing of it was lost. Blank lines are skipped.

  Raises:
    ValueError: (one sentence naming the file and line) a line before the last is not a JSON
      object: something other than a crash damaged the log.
  """
  if not p.exists():
    return []
  lines = p.read_bytes().split(b"\n")
  numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
  rows = []
  for n, (i, line) in enumerate(numbered):
    why = None
    try:
      row = json.loads(line)
      if not isinstance(row, dict):
        why = f"a JSON {type(row).__name__}, not an object"
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
      why = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
    if why is None:
      rows.append(row)
    elif n == len(numbered) - 1:
      logging.warning("dropping the torn last line %d of %s (%s).", i, p, why)
    else:
      raise ValueError(
        f"{p} line {i} is not a JSON object ({why}); only a torn last line (a crash "
        "mid-write) is dropped, so repair or delete that line."
      )
  return rows


def free_bytes(file: epath.Path) -> int | None:
  """Free bytes on the local file system holding ``file`` (or its nearest existing parent)."""
  if is_remote(file):
    return None
  folder = os.fspath(file)
  while not os.path.exists(folder) and os.path.dirname(folder) != folder:
    folder = os.path.dirname(folder)
  try:
    return shutil.disk_usage(folder).free
  except OSError:
    return None


class DiskFull(ValueError):
  """A write met a full disk; the message (one sentence) names the path and the sizes."""


def is_disk_full(e: BaseException | None) -> bool:
  """Whether ``e`` (or what caused it) is a full disk: :class:`DiskFull`, an OSError with ENOSPC,
  or the text TensorStore gives it in orbax's errors (``No space left on device [...='28']``)."""
  for _ in range(10):  # the exception and its causes
    if e is None:
      return False
    if isinstance(e, DiskFull) or (isinstance(e, OSError) and e.errno == errno.ENOSPC):
      return True
    if "No space left on device" in str(e):
      return True
    e = e.__cause__ or e.__context__
  return False


def write_error(file: str | os.PathLike, e: OSError, nbytes: int | None = None) -> ValueError:
  """One sentence for an OSError met writing ``file``: the path, and for a full disk the bytes
  being written and the bytes free."""
  if e.errno == errno.ENOSPC:
    free = free_bytes(epath.Path(file))
    size = f"writing {nbytes:,} bytes" if nbytes is not None else "writing"
    room = f", {free:,} bytes free" if free is not None else ""
    return DiskFull(
      f"no space left on the device of {file} ({size}{room}); free space and rerun the same "
      "command to resume from the newest checkpoint."
    )
  return ValueError(f"cannot write {file} ({e.strerror or e}).")


@contextlib.contextmanager
def _named_errors(file: epath.Path, nbytes: int):
  try:
    yield
  except OSError as e:
    raise write_error(file, e, nbytes) from None


def replace_atomically(file: epath.Path, text: str) -> None:
  """Replaces a local ``file`` with ``text`` whole or not at all: a temp file beside it, fsynced,
  then renamed over it, so a kill (or a full disk) mid-write leaves the previous version."""
  tmp = file.parent / f".{file.name}.tmp-{os.getpid()}"
  _remove_stale_temps(file)
  try:
    with open(tmp, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, file)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


def _remove_stale_temps(file: epath.Path) -> None:
  """Removes the temp files of ``file`` that a killed process left (``.NAME.tmp-PID`` whose
  process is gone): a kill -9 mid-replace skips the cleanup, and each would stay forever."""
  for tmp in file.parent.glob(f".{file.name}.tmp-*"):
    pid = tmp.name.rpartition("-")[2]
    if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
      tmp.unlink(missing_ok=True)


def pid_alive(pid) -> bool:
  """Whether a process of this machine has this pid (another user's counts; not an int: no)."""
  if not isinstance(pid, int) or pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


class JsonlFile:
  """An append-only JSON-lines file that starts over from ``rows`` (the rows a resume keeps).

  Rows reach storage on ``flush``. Local: the kept rows replace the file atomically (a kill
  while a resume drops rows leaves the old history whole), then new rows are appended (a kill -9
  loses nothing flushed). Remote: every row is kept in memory and ``flush`` rewrites the whole
  object, so what a kill -9 leaves is exactly what the last ``flush`` uploaded. No file is held
  open between flushes. A write that fails (a full disk) raises a ValueError naming the file.
  """

  def __init__(self, file: epath.Path, rows: list[dict]):
    self.path = file
    self._remote = is_remote(file)
    self._written: list[str] = []  # remote: every row; local: rows not yet appended
    self._pending = False
    text = [json.dumps(row) + "\n" for row in rows]
    with _named_errors(file, sum(map(len, text))):
      file.parent.mkdir(parents=True, exist_ok=True)
      if self._remote:
        self._written = text
        self._pending = True
      else:
        replace_atomically(file, "".join(text))

  def write(self, row: dict) -> None:
    self._written.append(json.dumps(row) + "\n")
    self._pending = True

  def flush(self) -> None:
    if not self._pending:
      return
    with _named_errors(self.path, sum(map(len, self._written))):
      if self._remote:
        self.path.write_text("".join(self._written))
      else:
        # one write call: a kill leaves at most one torn line, the last (see `read_rows`)
        with open(self.path, "a") as f:
          f.write("".join(self._written))
        self._written = []
    self._pending = False

  def close(self) -> None:
    self.flush()
