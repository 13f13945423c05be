"""``python -m knitjax.main --distributed`` as two real CPU processes (gloo collectives).

Each process has 2 fake CPU devices, so the colocated run's mesh (``data=-1``) spans 4 devices on
2 hosts: generation output is batch-sharded across the processes (every host needs all of it for
rewards and admission), and each host feeds its own share of the rows to the update. The two
processes must end on the same step and version with the same params (``param_norm`` is read
from each process's own replica), process 0 alone writes the metrics, and the checkpoint both
saved holds exactly those params.
"""

import json
import os
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from lab import without_device_count

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gloo_available() -> bool:
  try:
    from jax._src.lib import _jax
  except ImportError:
    return False
  return hasattr(_jax, "make_gloo_tcp_collectives")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _summary(log: str, pid: int) -> dict:
  """The line main logs on every process once training is done."""
  found = re.findall(rf"process {pid} of 2 finished: (\{{.*\}})", log)
  assert len(found) == 1, log[-3000:]
  return json.loads(found[0])


def _checkpoint_params(folder: str):
  """The params a checkpoint step holds, as NumPy arrays (no device layout needed)."""
  ckptr = ocp.PyTreeCheckpointer()
  tree = ckptr.metadata(folder).item_metadata.tree
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  return ckptr.restore(folder, args=ocp.args.PyTreeRestore(restore_args=args))["params"]


def _launch(tmp_path, extra=()):
  """Runs ``configs/arith_tiny.py:quick`` as two processes; returns the workdir and both logs."""
  workdir = tmp_path / "run"
  port = _free_port()
  env = without_device_count(os.environ)  # the config's mesh.cpu_devices: 2
  env["JAX_PLATFORMS"] = "cpu"
  cmd = [sys.executable, "-m", "knitjax.main", "--config", "configs/arith_tiny.py:quick"]
  cmd += ["--workdir", str(workdir), "--distributed", f"--coordinator_address=localhost:{port}"]
  cmd += ["--num_processes=2", *extra]
  logs = [tmp_path / f"log{pid}" for pid in (0, 1)]
  procs = []
  for pid in (0, 1):
    with open(logs[pid], "w") as log:
      procs.append(
        subprocess.Popen(
          [*cmd, f"--process_id={pid}"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
      )
  try:
    codes = [p.wait(timeout=240) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  out = [f.read_text() for f in logs]
  assert codes == [0, 0], f"exit codes {codes}\n{out[0][-3000:]}\n---\n{out[1][-3000:]}"
  return workdir, out


@pytest.mark.skipif(not _gloo_available(), reason="this jaxlib has no gloo CPU collectives")
def test_two_process_main_agrees_on_step_version_and_params(tmp_path):
  """Two consumers pack their own rows into the same number of sequences (from the consumer plan
  and the groups' metadata); PPO with a critic and the KL as a reward runs per segment. (One run
  for both checks: two trainer processes cost a minute of the suite.)"""
  extra = ["--config.layout.packing=pack", "--config.layout.pack_len=64"]
  extra += ["--config.loss.advantage=gae", "--config.loss.kl_coef=0.05"]
  extra += ["--config.loss.kl_penalty=reward"]
  workdir, out = _launch(tmp_path, extra)
  ends = [_summary(out[pid], pid) for pid in (0, 1)]
  assert ends[0]["step"] == ends[1]["step"] == 2
  assert ends[0]["version"] == ends[1]["version"] == 2  # quick: one update per step
  assert ends[0] == ends[1]  # loss and each replica's param_norm, bit for bit
  assert np.isfinite(ends[0]["param_norm"]) and ends[0]["param_norm"] > 0

  # Only process 0 writes metrics: each step once, ending where both processes ended.
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2] and [r["version"] for r in rows] == [1, 2]
  assert rows[-1]["param_norm"] == ends[1]["param_norm"]
  assert (workdir / "reward.png").exists()
  for r in rows:
    assert r["num_seqs"] == 256 and r["value_loss"] > 0  # the whole step's rows (32 x G=8)
    # The whole mini-batch's plan (each process packs 128 rows): several rows per sequence.
    assert r["pack_rows"] * r["pack_segments_mean"] == pytest.approx(256)
    assert r["pack_rows"] % 2 == 0
    assert r["pack_segments_max"] >= 2 and 0 < r["pack_fill"] <= 1

  # The checkpoint the two processes saved holds the params both report.
  params = _checkpoint_params(str(workdir / "checkpoints" / "2" / "state"))
  norm = np.sqrt(sum(np.sum(np.square(x.astype(np.float64))) for x in jax.tree.leaves(params)))
  np.testing.assert_allclose(norm, ends[1]["param_norm"], rtol=1e-5)


def test_processes_started_differently_stop_naming_the_difference(tmp_path):
  """Process 1 with another learning rate: both stop before building anything, each with one
  sentence naming the field (without the check both finished with diverged "replicas")."""
  if not _gloo_available():
    pytest.skip("this jaxlib has no gloo CPU collectives")
  port = _free_port()
  env = without_device_count(os.environ)  # --config.mesh.cpu_devices=1
  env["JAX_PLATFORMS"] = "cpu"
  cmd = [sys.executable, "-m", "knitjax.main", "--config", "configs/arith_tiny.py:quick"]
  cmd += ["--workdir", str(tmp_path / "run"), "--distributed", "--num_processes=2"]
  cmd += [f"--coordinator_address=127.0.0.1:{port}", "--config.mesh.cpu_devices=1"]
  extra = ([], ["--config.optimizer.lr=0.5"])
  procs = [
    subprocess.Popen(
      [*cmd, f"--process_id={k}", *extra[k]],
      cwd=REPO,
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
    )
    for k in (0, 1)
  ]
  try:
    errs = [p.communicate(timeout=120)[1] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for k, (p, err) in enumerate(zip(procs, errs, strict=True)):
    last = err.strip().splitlines()[-1]
    assert p.returncode == 1, (k, err[-2000:])
    assert last.startswith("error: trainer processes") and "config.optimizer.lr" in last, last
