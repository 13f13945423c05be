"""``knitjax.export`` and ``knitjax.eval`` on hostile workdirs and output folders: one sentence
naming the path, nothing created, no stale files left in an export."""

import json
import os
import re

import pytest

from configs import arith_tiny
from knitjax.config import from_config_dict
from knitjax.eval import evaluate
from knitjax.export import export


@pytest.fixture(scope="module")
def config():
  return from_config_dict(arith_tiny.get_config("quick"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, config):
  """A workdir holding a real checkpoint of step 1 (saved from the initial state, no training)."""
  from knitjax.runtime import builder
  from knitjax.runtime.learner import RunState

  workdir = str(tmp_path_factory.mktemp("run"))
  mesh = builder.build_mesh(config)
  _, learner = builder.build_learner(config, mesh, workdir)
  learner.version = config.admission.minibatches  # one train step's updates
  assert learner.maybe_save(1, 1, lambda: RunState())
  learner.close()
  return workdir


def _fake_checkpoint(workdir):
  """A folder that passes for a finished checkpoint by name: the checks come before any restore."""
  (workdir / "checkpoints" / "1").mkdir(parents=True)
  return str(workdir)


@pytest.mark.parametrize("run", [evaluate, lambda c, w: export(c, w, w + "_hf")])
def test_a_workdir_without_a_checkpoint_is_refused_and_not_created(tmp_path, config, run):
  missing = str(tmp_path / "runs" / "typo")
  with pytest.raises(ValueError, match=f"^--workdir {missing} does not exist; give the folder"):
    run(config, missing)
  assert not os.path.exists(tmp_path / "runs")
  (tmp_path / "empty").mkdir()
  empty = str(tmp_path / "empty")
  with pytest.raises(ValueError, match=f"^--workdir {empty} holds no checkpoint"):
    run(config, empty)
  assert os.listdir(empty) == []
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="is a file, not a folder"):
    run(config, str(tmp_path / "file"))


def test_eval_on_an_unwritable_workdir_is_refused_before_evaluating(tmp_path, config, monkeypatch):
  """Root writes anywhere, so the failing write is simulated: the check must come first (the
  evaluation used to run, then crash writing its result, which was lost)."""
  from etils import epath

  workdir = _fake_checkpoint(tmp_path)
  real = type(epath.Path(workdir)).write_text

  def read_only(self, *args, **kwargs):
    if str(self).startswith(workdir):
      raise PermissionError(13, "Permission denied")
    return real(self, *args, **kwargs)

  monkeypatch.setattr(type(epath.Path(workdir)), "write_text", read_only)
  with pytest.raises(ValueError, match=f"^--workdir {workdir} is not writable"):
    evaluate(config, workdir)


def test_export_refuses_an_unusable_out_folder(tmp_path, config, monkeypatch):
  workdir = _fake_checkpoint(tmp_path / "run")
  (tmp_path / "file").write_text("x")
  old = tmp_path / "old_hf"
  old.mkdir()
  (old / "config.json").write_text("{}")
  cases = [
    (tmp_path / "file", "is a file, not a folder"),
    (tmp_path / "file" / "hf", "cannot be created: its folder"),
    (old, "is not empty (it holds config.json); pass --overwrite to replace it whole"),
  ]
  (tmp_path / "read_only").mkdir()
  cases.append((tmp_path / "read_only", "is not writable (permission denied)"))
  real_access = os.access  # root may write anywhere: a read-only folder is simulated
  monkeypatch.setattr(
    os, "access", lambda p, mode: not str(p).endswith("read_only") and real_access(p, mode)
  )
  for out, expected in cases:
    with pytest.raises(ValueError, match=f"^--out {re.escape(str(out))} .*{re.escape(expected)}"):
      export(config, workdir, str(out))
  assert (old / "config.json").read_text() == "{}"


def test_export_over_an_older_sharded_export_leaves_no_stale_file(tmp_path, config, trained):
  from knitjax.models import hf

  out = tmp_path / "hf"
  out.mkdir()
  (out / "model-00001-of-00002.safetensors").write_bytes(b"old")
  (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')
  with pytest.raises(ValueError, match="is not empty"):
    export(config, trained, str(out))
  written = export(config, trained, str(out), overwrite=True)
  assert written == {"step": 1, "checkpoint": True, "out": str(out), "dtype": "float32"}
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  assert sorted(os.listdir(tmp_path)) == ["hf"]  # no temp or old folder beside it
  assert json.loads((out / "config.json").read_text())["vocab_size"] == config.model.vocab_size
  assert hf.config_from_hf(str(out)).vocab_size == config.model.vocab_size


def test_a_failed_export_leaves_the_old_folder_whole(tmp_path, config, trained, monkeypatch):
  import errno

  from knitjax.models import hf

  out = tmp_path / "hf"
  out.mkdir()
  (out / "config.json").write_text("{}")

  def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(hf, "write_streamed", full_disk)
  with pytest.raises(ValueError, match=f"^no space left on the device of {out} "):
    export(config, trained, str(out), overwrite=True)
  assert sorted(os.listdir(tmp_path)) == ["hf"] and os.listdir(out) == ["config.json"]


def _run_files(workdir):
  return sorted(
    os.path.relpath(os.path.join(d, f), workdir) for d, _, fs in os.walk(workdir) for f in fs
  )


def test_export_refuses_an_out_that_is_holds_or_lies_inside_the_workdir(tmp_path, config):
  """Issue 47: ``--out W --overwrite`` (or W's parent, or ``W/checkpoints``) replaced the run
  with the export; now each is refused before anything is touched, through symlinks too."""
  workdir = _fake_checkpoint(tmp_path / "runs" / "a")
  (tmp_path / "runs" / "a" / "metrics.jsonl").write_text('{"step": 1}\n')
  (tmp_path / "link").symlink_to(tmp_path / "runs")
  before = _run_files(tmp_path / "runs")
  cases = [
    (workdir, "is"),
    (str(tmp_path / "runs"), "holds"),
    (str(tmp_path), "holds"),
    (os.path.join(workdir, "checkpoints"), "lies inside"),
    (os.path.join(workdir, "hf"), "lies inside"),
    (str(tmp_path / "link" / "a"), "is"),  # the workdir reached through a linked parent
  ]
  for out, how in cases:
    with pytest.raises(ValueError, match=f"^--out {re.escape(out)} {how} the workdir {workdir}; "):
      export(config, workdir, out, overwrite=True)
  assert _run_files(tmp_path / "runs") == before


def test_export_overwrite_replaces_only_a_previous_export(tmp_path, config):
  workdir = _fake_checkpoint(tmp_path / "run")
  mine = tmp_path / "mine"
  mine.mkdir()
  for name in ["config.json", "model.safetensors", "notes.txt"]:
    (mine / name).write_text("x")
  with pytest.raises(ValueError, match=f"^--out {mine} holds notes.txt, which no export wrote; "):
    export(config, workdir, str(mine), overwrite=True)
  nested = tmp_path / "nested"
  (nested / "model.safetensors").mkdir(parents=True)  # a folder, not the file an export writes
  with pytest.raises(ValueError, match="holds model.safetensors, which no export wrote"):
    export(config, workdir, str(nested), overwrite=True)
  assert sorted(os.listdir(mine)) == ["config.json", "model.safetensors", "notes.txt"]


def test_export_refuses_a_symlink_out(tmp_path, config):
  """``--out LINK --overwrite`` replaced the link with a folder and left ``.LINK.tmp-PID.old``."""
  workdir = _fake_checkpoint(tmp_path / "run")
  (tmp_path / "real_hf").mkdir()
  (tmp_path / "real_hf" / "config.json").write_text("{}")
  (tmp_path / "hf").symlink_to(tmp_path / "real_hf")
  with pytest.raises(ValueError, match=f"^--out {tmp_path / 'hf'} is a symlink; give the real "):
    export(config, workdir, str(tmp_path / "hf"), overwrite=True)
  assert sorted(os.listdir(tmp_path)) == ["hf", "real_hf", "run"]
  assert os.path.islink(tmp_path / "hf")
