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
