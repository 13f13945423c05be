"""A disaggregated run whose rollout is another process: ``--role=rollout`` beside the trainer.

Two real processes, two CPU devices each: the rollout host is started first (it waits for the
trainer's endpoint), the trainer trains on both of its devices, the host generates on its own
two, payloads stay in the host's storage unit, weights are pulled device to device each version
(jax.experimental.transfer). The run must end on both sides, every consumed group must have been
offered once and consumed once, the depth bound must hold, and the host must have generated
every offered group and adopted the versions the trainer published.
"""

import errno
import json
import os
import re
import stat
import subprocess
import sys

import pytest

from knitjax.config import from_config_dict
from knitjax.runtime import rollout_hosts
from tests import tiny

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = "configs/arith_disagg.py:quick"


def _transfer_available() -> bool:
  try:
    from jax.experimental import transfer  # noqa: F401
  except ImportError:
    return False
  return True


def _config(**runtime):
  sys.path.insert(0, REPO)
  from configs import arith_disagg

  c = arith_disagg.get_config("quick")
  for k, v in runtime.items():
    tiny.set_fields(c, **{k: v})
  return from_config_dict(c)


@pytest.mark.parametrize(
  ("runtime", "match"),
  [
    (dict(mode="colocated"), "needs config.topology.mode='disaggregated'"),
    (dict(rollout_workers=2), "not accepted with rollout_workers or storage='ray'"),
    (dict(rollout_listen="localhost"), "is not accepted; give host:port"),
    (
      dict(rollout_listen="127.0.0.1:70000"),
      r"'127.0.0.1:70000' .* port 70000 is outside 0..65535",
    ),
    (dict(rollout_listen="127.0.0.1:-1"), r"'127.0.0.1:-1' .* port -1 is outside 0..65535"),
    (dict(rollout_listen="no-such-host.invalid:0"), "host 'no-such-host.invalid' does not resolve"),
  ],
)
def test_rollout_hosts_config_errors(runtime, match):
  with pytest.raises(ValueError, match=match):
    _config(rollout_hosts=1, **runtime)


def _token_file(workdir, data: bytes, mode=0o600):
  workdir.mkdir(exist_ok=True)
  path = workdir / "rollout_token"
  path.write_bytes(data)
  path.chmod(mode)
  return path


@pytest.mark.parametrize("data", [b"", b"x", b"a" * 31 + b"\n"])
def test_a_short_token_file_is_refused_naming_it(tmp_path, monkeypatch, data):
  monkeypatch.delenv(rollout_hosts.TOKEN_ENV, raising=False)
  path = _token_file(tmp_path, data)
  for create in (True, False):  # the trainer does not reuse it, the host does not accept it
    with pytest.raises(ValueError, match=rf"^the rollout token {path} holds \d+ bytes, fewer than"):
      rollout_hosts.run_token(str(tmp_path), create=create)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o602])
def test_a_token_file_open_to_others_is_refused_naming_it(tmp_path, monkeypatch, mode):
  monkeypatch.delenv(rollout_hosts.TOKEN_ENV, raising=False)
  path = _token_file(tmp_path, b"k" * 64, mode)
  with pytest.raises(ValueError, match=rf"^the rollout token {path} is open to group or others"):
    rollout_hosts.run_token(str(tmp_path), create=False)


@pytest.mark.parametrize("value", ["", "short"])
def test_a_short_token_variable_is_refused(tmp_path, monkeypatch, value):
  monkeypatch.setenv(rollout_hosts.TOKEN_ENV, value)
  with pytest.raises(ValueError, match=r"^KNITJAX_ROLLOUT_TOKEN holds a \d-byte token"):
    rollout_hosts.run_token(str(tmp_path), create=True)
  monkeypatch.setenv(rollout_hosts.TOKEN_ENV, "v" * 32)
  assert rollout_hosts.run_token(str(tmp_path), create=True) == b"v" * 32


def test_the_token_file_is_created_whole_and_owner_only(tmp_path, monkeypatch):
  monkeypatch.delenv(rollout_hosts.TOKEN_ENV, raising=False)
  token = rollout_hosts.run_token(str(tmp_path / "run"), create=True)
  path = tmp_path / "run" / "rollout_token"
  assert len(token) == 64 and path.read_bytes() == token
  assert stat.S_IMODE(path.stat().st_mode) == 0o600
  assert os.listdir(path.parent) == ["rollout_token"]
  assert rollout_hosts.run_token(str(tmp_path / "run"), create=False) == token


def test_a_full_disk_while_creating_the_token_leaves_no_file(tmp_path, monkeypatch):
  monkeypatch.delenv(rollout_hosts.TOKEN_ENV, raising=False)
  (tmp_path / "run").mkdir()

  def full(fd, data):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  with monkeypatch.context() as m:
    m.setattr(os, "write", full)
    with pytest.raises(ValueError) as e:
      rollout_hosts.run_token(str(tmp_path / "run"), create=True)
  path = tmp_path / "run" / "rollout_token"
  assert str(e.value) == (
    f"could not write the rollout token {path} (No space left on device); free space in the "
    "workdir or set KNITJAX_ROLLOUT_TOKEN."
  )
  assert os.listdir(tmp_path / "run") == []
  # the next run creates a good one
  assert len(rollout_hosts.run_token(str(tmp_path / "run"), create=True)) == 64


@pytest.mark.skipif(not _transfer_available(), reason="this jax has no jax.experimental.transfer")
def test_trainer_and_one_rollout_host_run_three_steps(tmp_path):
  workdir = tmp_path / "run"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
  env.pop("XLA_FLAGS", None)  # config.mesh.cpu_devices=2 asks for two devices per process
  env.pop("KNITJAX_ROLLOUT_TOKEN", None)
  base = [sys.executable, "-m", "knitjax.main", "--config", CONFIG, "--workdir", str(workdir)]
  base += ["--config.topology.rollout_hosts=1", "--config.mesh.cpu_devices=2"]
  base += ["--config.topology.rollout_host_wait_s=200"]
  logs = {role: tmp_path / f"{role}.log" for role in ("rollout", "train")}
  procs = {}
  for role in ("rollout", "train"):  # the host first: it waits for the trainer's endpoint
    with open(logs[role], "w") as log:
      procs[role] = subprocess.Popen(
        [*base, f"--role={role}"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
      )
  try:
    codes = {role: p.wait(timeout=240) for role, p in procs.items()}
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()
  out = {role: f.read_text() for role, f in logs.items()}
  assert codes == {"rollout": 0, "train": 0}, (
    f"{codes}\n{out['train'][-3000:]}\n---\n" + out["rollout"][-3000:]
  )
  assert re.search(
    r"rollout host 0 \(.*pid \d+, 127.0.0.1:\d+\) attached \(2 devices\)", out["train"]
  )
  assert "rollout on 1 rollout hosts, training steps 1..3 on 2 devices" in out["train"]

  consumed = [json.loads(x) for x in (workdir / "consumed.jsonl").read_text().splitlines()]
  offered = [json.loads(x) for x in (workdir / "offered.jsonl").read_text().splitlines()]
  assert [(r["step"], r["index"]) for r in consumed] == [(s, j) for s in range(3) for j in (0, 1)]
  ids = [g for r in consumed for g in r["group_ids"]]
  assert len(ids) == len(set(ids)) == 3 * 8
  offered_ids = [r["group_id"] for r in offered]
  assert len(offered_ids) == len(set(offered_ids)) and set(ids) <= set(offered_ids)
  for r in consumed:  # the depth bound (max_lag_steps=1, M=2): at most 2M - 1 versions behind
    assert all(0 <= r["consume_version"] - v <= 3 for v in r["gen_versions"]), r
  assert max(v for r in consumed for v in r["gen_versions"]) >= 1  # new versions reached the host

  host = json.loads(re.findall(r"rollout host finished: (\{.*\})", out["rollout"])[0])
  assert host["unit_id"] == 0 and host["groups"] >= len(offered_ids)
  assert host["versions"] >= 2
  # the token the two sides share is the owner's alone
  token = workdir / "rollout_token"
  assert stat.S_IMODE(token.stat().st_mode) == 0o600
  metrics = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in metrics] == [1, 2, 3]
