"""Hostile file-system conditions around a workdir: a kill or a full disk while ``metrics.jsonl``
is rewritten, and two runs on one workdir."""

import errno
import json

import pytest
from etils import epath

from knitjax import workdir as wd


class _FailingFile:
  """A file that writes part of what it is given, then fails as a full disk (or a kill) would."""

  def __init__(self, f):
    self._f = f

  def write(self, text):
    self._f.write(text[: len(text) // 2])
    self._f.flush()
    raise OSError(errno.ENOSPC, "No space left on device")

  def writelines(self, lines):
    self.write("".join(lines))

  def __getattr__(self, name):
    return getattr(self._f, name)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._f.close()


def _failing_open(file, mode="r", *args, **kwargs):
  f = open(file, mode, *args, **kwargs)  # noqa: SIM115
  return _FailingFile(f) if "w" in mode or "a" in mode else f


def test_a_failed_rewrite_on_resume_keeps_the_metrics_history(tmp_path, monkeypatch):
  """Resume drops rows after the checkpoint by rewriting metrics.jsonl; a kill or ENOSPC in that
  window must leave the old history whole (it used to leave a truncated or empty file)."""
  path = tmp_path / "metrics.jsonl"
  rows = [{"step": s, "loss": s / 10} for s in range(1, 6)]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  monkeypatch.setattr(wd, "open", _failing_open, raising=False)
  with pytest.raises(ValueError, match=f"no space left on the device of {path}"):
    wd.JsonlFile(epath.Path(path), rows[:3])
  assert [json.loads(line) for line in path.read_text().splitlines()] == rows
  assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp file left
  monkeypatch.undo()
  f = wd.JsonlFile(epath.Path(path), rows[:3])  # the resume once space is back
  f.write({"step": 4, "loss": 0.0})
  f.close()
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_a_full_disk_at_a_metrics_flush_is_one_sentence(tmp_path, monkeypatch):
  path = epath.Path(tmp_path / "metrics.jsonl")
  f = wd.JsonlFile(path, [{"step": 1}])
  f.write({"step": 2})
  monkeypatch.setattr(wd, "open", _failing_open, raising=False)
  with pytest.raises(ValueError) as e:
    f.flush()
  message = str(e.value)
  assert message.startswith(f"no space left on the device of {path} (writing 12 bytes, ")
  assert "bytes free); free space and rerun the same command" in message
  assert "\n" not in message


def test_a_second_run_on_a_workdir_is_refused_naming_the_first(tmp_path):
  import os
  import socket

  from knitjax.runtime import workdir_lock

  with workdir_lock.hold(str(tmp_path)):
    with pytest.raises(ValueError) as e, workdir_lock.hold(str(tmp_path)):
      pass
    message = str(e.value)
    assert message.startswith(f"--workdir {tmp_path} is in use by another run (pid {os.getpid()}")
    assert f"on {socket.gethostname()}, started 20" in message and "UTC)" in message
    with workdir_lock.hold(str(tmp_path), primary=False):  # other processes of the same run
      pass
  with workdir_lock.hold(str(tmp_path)):  # released at the end of the run
    pass


def test_a_dead_run_does_not_hold_the_workdir(tmp_path):
  import subprocess
  import sys

  from knitjax.runtime import workdir_lock

  holder = subprocess.Popen(
    [
      sys.executable,
      "-c",
      "import sys, time; from knitjax.runtime import workdir_lock as w\n"
      f"with w.hold({str(tmp_path)!r}):\n  print('held', flush=True); time.sleep(60)",
    ],
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline() == "held\n"
    expected = f"in use by another run \\(pid {holder.pid} on "
    with pytest.raises(ValueError, match=expected), workdir_lock.hold(str(tmp_path)):
      pass
  finally:
    holder.kill()
    holder.wait()
  with workdir_lock.hold(str(tmp_path)):  # SIGKILL released it
    pass


def test_train_refuses_a_workdir_another_run_holds(tmp_path):
  from configs import arith_tiny
  from knitjax.config import from_config_dict
  from knitjax.run import train
  from knitjax.runtime import workdir_lock

  config = from_config_dict(arith_tiny.get_config("quick"))
  with workdir_lock.hold(str(tmp_path)), pytest.raises(ValueError, match="in use by another"):
    train(config, str(tmp_path))
  assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


@pytest.fixture
def fake_bucket(tmp_path, monkeypatch):
  """``gs://bucket/x`` served from ``<tmp>/gcs/bucket/x`` through fsspec (epath's route)."""
  from fsspec.implementations.dirfs import DirFileSystem
  from fsspec.implementations.local import LocalFileSystem
  from fsspec.registry import _registry

  root = tmp_path / "gcs"
  (root / "bucket").mkdir(parents=True)

  class FakeGcs(DirFileSystem):
    protocol = ("gs", "gcs")
    cachable = False

    def __init__(self, *args, **kwargs):
      super().__init__(path=str(root), fs=LocalFileSystem())

  monkeypatch.setitem(_registry, "gs", FakeGcs)
  monkeypatch.setitem(_registry, "gcs", FakeGcs)
  return root / "bucket"


def test_a_bucket_workdir_lock_has_an_owner_and_a_heartbeat(fake_bucket):
  from knitjax.runtime import workdir_lock

  url = "gs://bucket/run"
  with workdir_lock.hold(url, ttl_s=60):
    owner = json.loads((fake_bucket / "run" / ".lock").read_text())
    expected = r"in use by another run \(pid \d+ on .*heartbeat 0 s ago"
    with pytest.raises(ValueError, match=expected), workdir_lock.hold(url, ttl_s=60):
      pass
  assert not (fake_bucket / "run" / ".lock").exists()  # released
  owner["heartbeat"] -= 120  # a run that died without releasing: taken over after ttl_s
  (fake_bucket / "run" / ".lock").write_text(json.dumps(owner))
  with workdir_lock.hold(url, ttl_s=60):
    assert json.loads((fake_bucket / "run" / ".lock").read_text())["token"] != owner["token"]


def _log(path, tail):
  path.write_text('{"step": 1, "seq": 1}\n{"step": 2, "seq": 2}\n' + tail)
  return epath.Path(path)


@pytest.mark.parametrize("tail", ['{"step": 3, "group_ids": [4', '{"step": 3, "gr', "[3]\n"])
def test_read_rows_drops_a_torn_last_line_only(tmp_path, tail, caplog):
  """Issue 47: a torn last line of consumed.jsonl blocked resume with a bare json error."""
  import logging

  path = _log(tmp_path / "consumed.jsonl", tail)
  with caplog.at_level(logging.WARNING):
    assert wd.read_rows(path) == [{"step": 1, "seq": 1}, {"step": 2, "seq": 2}]
  assert any(f"dropping the torn last line 3 of {path}" in r.getMessage() for r in caplog.records)
  path.write_text(path.read_text() + '\n{"step": 3, "seq": 3}\n')  # the torn line is not last now
  with pytest.raises(ValueError) as e:
    wd.read_rows(path)
  assert str(e.value).startswith(f"{path} line 3 is not a JSON object (")
  assert str(e.value).endswith(
    "only a torn last line (a crash mid-write) is dropped, so repair or delete that line."
  )


def test_every_append_only_log_is_read_by_the_one_reader(tmp_path):
  """consumed, offered, fetched.p<k>, metrics and eval logs all drop a torn last line on resume."""
  from knitjax.distributed.trainer_processes import PlanBook
  from knitjax.runtime.evaluation import read_eval
  from knitjax.runtime.metrics import read_metrics
  from knitjax.runtime.pipeline import _jsonl_log

  torn = '{"step": 3, "group_ids": [4'
  for name in ["consumed.jsonl", "offered.jsonl"]:
    _log(tmp_path / name, torn)
    _jsonl_log(str(tmp_path), name, keep=lambda r: True).close()
    assert (tmp_path / name).read_text() == '{"step": 1, "seq": 1}\n{"step": 2, "seq": 2}\n'
  _log(tmp_path / "fetched.p0.jsonl", torn)
  PlanBook(str(tmp_path), minibatches=1, start_step=3, locality_slack=0.0)
  assert (tmp_path / "fetched.p0.jsonl").read_text().count("\n") == 2
  for name, read in [("metrics.jsonl", read_metrics), ("eval.jsonl", read_eval)]:
    _log(tmp_path / name, torn)
    assert [r["step"] for r in read(str(tmp_path))] == [1, 2]


def test_a_flush_is_one_write_so_a_kill_tears_at_most_one_line(tmp_path, monkeypatch):
  writes = []

  class _Counting:
    def __init__(self, f):
      self._f = f

    def write(self, text):
      writes.append(text)
      return self._f.write(text)

    def __getattr__(self, name):
      return getattr(self._f, name)

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      self._f.close()

  f = wd.JsonlFile(epath.Path(tmp_path / "consumed.jsonl"), [])
  for step in range(3):
    f.write({"step": step})
  monkeypatch.setattr(wd, "open", lambda *a, **k: _Counting(open(*a, **k)), raising=False)  # noqa: SIM115
  f.flush()
  assert writes == ['{"step": 0}\n{"step": 1}\n{"step": 2}\n']


def test_a_replace_removes_the_temp_files_killed_writers_left(tmp_path):
  """A kill -9 during a metrics rewrite left ``.metrics.jsonl.tmp-PID`` for good (issue 47)."""
  import os
  import subprocess

  from knitjax.workdir import replace_atomically

  dead = subprocess.Popen(["true"])
  dead.wait()
  target = tmp_path / "metrics.jsonl"
  stale = tmp_path / f".metrics.jsonl.tmp-{dead.pid}"
  stale.write_text("half a rewrite")
  live = tmp_path / f".metrics.jsonl.tmp-{os.getppid()}"  # a live writer's: kept
  live.write_text("in progress")
  replace_atomically(epath.Path(target), '{"step": 1}\n')
  assert target.read_text() == '{"step": 1}\n'
  assert not stale.exists() and live.exists()
