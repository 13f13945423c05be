"""A multi-process run on this machine: the tests', fault suite's and benchmarks' launcher.

`launch` starts the processes of one ``--distributed`` run of `knitjax.main` on loopback (what a
user types once per process, see docs/disaggregated.md) and collects their exit codes and stderr.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from lab import REPO, without_device_count


def _env(extra: dict[str, str]) -> dict[str, str]:
  env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}
  return without_device_count(env)  # each process takes the config's cpu_devices


def launch(
  args: list[str],
  workdir: str,
  envs: list[dict],
  *,
  timeout: float = 900,
  on_start=None,
  module: str = "knitjax.main",
):
  """Runs ``python -m MODULE ARGS --workdir WORKDIR`` as ``len(envs)`` processes of one
  ``--distributed`` run (coordinator on a free loopback port), process ``k`` with the extra
  environment ``envs[k]`` and its own devices (``config.mesh.cpu_devices``); ``on_start()`` runs
  once all are started. Returns each process's ``(exit code, stderr)``; each process's stderr is
  also kept in ``WORKDIR/stderr.p<k>.<ns>``. Past ``timeout`` seconds the processes still
  running are killed and ``subprocess.TimeoutExpired`` is raised. ``module`` is
  ``knitjax.main`` or an entry point that wraps it (``lab.batch_dump``)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  cmd = [sys.executable, "-m", module, *args, f"--workdir={workdir}", "--distributed"]
  cmd += [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={len(envs)}"]
  procs, errs = [], []
  os.makedirs(workdir, exist_ok=True)
  for k, env in enumerate(envs):
    err = open(os.path.join(workdir, f"stderr.p{k}.{time.time_ns()}"), "w+")  # noqa: SIM115
    errs.append(err)
    procs.append(
      subprocess.Popen(
        [*cmd, f"--process_id={k}"],
        cwd=REPO,
        env=_env(env),
        stdout=subprocess.DEVNULL,
        stderr=err,
      )
    )
  try:
    if on_start is not None:
      on_start()
    deadline = time.time() + timeout
    codes = [p.wait(timeout=max(1.0, deadline - time.time())) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  out = []
  for code, err in zip(codes, errs, strict=True):
    err.seek(0)
    out.append((code, err.read()))
    err.close()
  return out
