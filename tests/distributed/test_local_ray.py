"""A local Ray is started lean (no idle workers prestarted) and as guarded as before; what
ensure_ray passes to ray.init, checked without starting Ray (tests/runtime/test_ray_faults.py
starts it)."""

import os
import re
import sys
import types

import pytest

from knitjax.distributed import local_ray


def test_local_start_prestarts_no_workers_and_keeps_its_guards():
  kwargs = local_ray.local_init_kwargs()
  assert kwargs == {
    "include_dashboard": False,
    "_system_config": {
      "enable_metrics_collection": False,
      "prestart_worker_first_driver": False,
    },
  }


def _fake_ray(calls: list) -> types.ModuleType:
  ray = types.ModuleType("ray")
  ray.is_initialized = lambda: False

  def init(**kwargs):
    calls.append((kwargs, os.environ.get("AUTOSCALER_METRIC_PORT")))

  ray.init = init
  return ray


def test_ensure_ray_passes_the_lean_settings_and_restores_the_monitor_port(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setitem(sys.modules, "ray", _fake_ray(calls))
  monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "auth_token"))
  monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
  monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
  monkeypatch.setenv("AUTOSCALER_METRIC_PORT", "44217")
  local_ray.ensure_ray("")
  assert calls == [(local_ray.local_init_kwargs(), "-1")]  # the monitor serves no metrics
  assert os.environ["AUTOSCALER_METRIC_PORT"] == "44217"
  assert (tmp_path / "auth_token").stat().st_mode & 0o077 == 0


def test_joining_a_cluster_passes_none_of_the_local_settings(monkeypatch):
  calls = []
  monkeypatch.setitem(sys.modules, "ray", _fake_ray(calls))
  monkeypatch.delenv("AUTOSCALER_METRIC_PORT", raising=False)
  local_ray.ensure_ray("ray://head:10001")
  assert calls == [({"address": "ray://head:10001", "include_dashboard": False}, None)]


def test_the_run_keeps_its_own_sigterm_and_sigint_handlers_across_ray_init(monkeypatch):
  """ray.init sets SIGTERM to sys.exit (and its core worker a native handler that aborts with a
  stack); a run's handlers, which stop it in one line, are put back once Ray has started."""
  import signal

  ray = types.ModuleType("ray")
  ray.is_initialized = lambda: False
  ray.init = lambda **kwargs: [signal.signal(s, lambda *a: None) for s in (15, 2)]
  monkeypatch.setitem(sys.modules, "ray", ray)

  def ours(signum, frame):
    raise AssertionError("never called here")

  saved = {s: signal.signal(s, ours) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    local_ray.ensure_ray("ray://head:10001")
    assert signal.getsignal(signal.SIGTERM) is ours
    assert signal.getsignal(signal.SIGINT) is ours
  finally:
    for s, handler in saved.items():
      signal.signal(s, handler)


def test_an_error_of_the_ray_cluster_is_one_sentence_naming_it():
  """A partitioned node's actor, raised from inside the run's own code (as `release_groups`
  does), is said in one sentence; anything else is not Ray's to explain."""
  unschedulable = type("ActorUnschedulableError", (Exception,), {"__module__": "ray.exceptions"})
  try:
    try:
      raise unschedulable("The actor is not schedulable:\nThe node ... doesn't exist any more.")
    except Exception as e:
      raise RuntimeError("while releasing groups") from e
  except RuntimeError as outer:
    sentence = local_ray.ray_failure(outer)
  assert sentence.startswith("the run's Ray cluster lost a part the run needs (Actor")
  assert "doesn't exist any more" in sentence and "`ray status`" in sentence
  assert local_ray.ray_failure(ValueError("not Ray's")) is None


def test_a_local_ray_for_a_run_authenticates_with_that_runs_own_token(tmp_path, monkeypatch):
  """The token lives in the run's workdir (0600), not in the user's ~/.ray shared by every run;
  a token the user chose (RAY_AUTH_TOKEN_PATH) wins."""
  calls = []
  monkeypatch.setitem(sys.modules, "ray", _fake_ray(calls))
  monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
  monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
  monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
  local_ray.ensure_ray("", token_dir=str(tmp_path))
  token = tmp_path / "ray_token"
  assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(token)
  assert token.stat().st_mode & 0o077 == 0 and len(token.read_text()) == 64
  mine = tmp_path / "mine"
  monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(mine))
  local_ray.ensure_ray("", token_dir=str(tmp_path / "other_run"))
  assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(mine)


def _token_kinds(tmp_path):
  folder = tmp_path / "folder"
  folder.mkdir()
  fifo = tmp_path / "fifo"
  os.mkfifo(fifo)
  binary = tmp_path / "binary"
  binary.write_bytes(b"\xff\xfe token")
  return {
    folder: r"is a directory, not a regular file",
    fifo: r"is a FIFO, not a regular file",
    binary: r"is not UTF-8 text",
  }


def test_a_token_that_is_not_a_regular_utf8_file_is_one_sentence_naming_it(tmp_path, monkeypatch):
  """Ray fails on a directory with a traceback, waits forever on a FIFO, and names no file for
  bytes that are not UTF-8: each is refused before Ray starts, naming the file."""
  calls = []
  monkeypatch.setitem(sys.modules, "ray", _fake_ray(calls))
  monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
  monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
  for path, problem in _token_kinds(tmp_path).items():
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path))
    for address in ("", "ray://head:10001"):  # a local start and a join
      with pytest.raises(ValueError) as e:
        local_ray.ensure_ray(address)
      msg = str(e.value)
      assert msg.startswith(f"Ray's token {path} ") and re.search(problem, msg), msg
      assert msg.endswith("point RAY_AUTH_TOKEN_PATH at the file that holds the token (64 hex "
                          "digits).")  # fmt: skip
  assert calls == []  # Ray never started


def test_a_regular_utf8_token_passes_the_check(tmp_path, monkeypatch):
  token = tmp_path / "token"
  token.write_text("ab" * 32)
  monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
  monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
  local_ray.check_ray_token()
  monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
  local_ray.check_ray_token()  # a local start makes it
