"""One Ray cluster across the hosts of an emulated cluster (`lab.cluster.hosts.Cluster`).

A Ray head on one host and a Ray node on every other, each bound to its host's own address, every
Ray process authenticating with the run's own token (``WORKDIR/ray_token``, 0600). The head can
offer no CPUs (``head_cpus=0``): then actors that ask for a CPU, such as Ray rollout actors
(`knitjax.distributed.ray_rollout`), land on the other hosts' nodes, and storage units follow
them (a hard node affinity), so payloads cross the shaped links to reach the trainer on the
head's host.

The processes `ray start` leaves behind live in the host's namespace: `Cluster.close` ends them
with the namespaces; `stop` ends one host's Ray processes earlier (by their ids, not by name: other
Ray clusters on this machine are not touched).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from lab import REPO, without_device_count
from lab.cluster import net
from lab.cluster.hosts import Cluster

RAY_PORT = 6379
_TEMP_RE = re.compile(rf"^ray_{net.PREFIX}(\d+)")  # ray_kj<pid>, ray_kj<pid>h: a cluster's


def private_temp_dir(tag: str, suffix: str = "", *, root: str | None = None, alive=None) -> str:
  """``TMP/ray_<tag><suffix>``, made owner-only (0700): give Ray its subfolder ``ray``.

  Ray makes its temp folder readable and writable by every user (0777, for shared machines), so
  the privacy is this parent's. Folders of a cluster whose process died (a kill -9 skips the
  cleanup) are removed first.
  """
  root = root or tempfile.gettempdir()
  for name in os.listdir(root):
    if (m := _TEMP_RE.match(name)) and not (alive or net.pid_alive)(int(m[1])):
      shutil.rmtree(os.path.join(root, name), ignore_errors=True)
  path = os.path.join(root, f"ray_{tag}{suffix}")
  os.makedirs(path, mode=0o700, exist_ok=True)
  os.chmod(path, 0o700)  # the umask, or a folder of this process made before
  return path


def ray_env(workdir: str) -> dict[str, str]:
  """The environment of every Ray process and driver of the cluster: the run's token (0600),
  no inherited ``RAY_*`` settings or fake-device count, JAX on CPU, the repository on the path."""
  from knitjax.distributed.local_ray import private_ray_token

  path = os.path.join(os.path.abspath(workdir), "ray_token")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  saved = os.environ.get("RAY_AUTH_TOKEN_PATH")
  os.environ["RAY_AUTH_TOKEN_PATH"] = path
  try:
    private_ray_token()
  finally:
    if saved is None:
      os.environ.pop("RAY_AUTH_TOKEN_PATH")
    else:
      os.environ["RAY_AUTH_TOKEN_PATH"] = saved
  env = {k: v for k, v in without_device_count(os.environ).items() if not k.startswith("RAY_")}
  env.update(
    RAY_AUTH_MODE="token",
    RAY_AUTH_TOKEN_PATH=path,
    RAY_USAGE_STATS_ENABLED="0",
    JAX_PLATFORMS="cpu",
    PYTHONPATH=REPO,
  )
  return env


def start(
  cluster: Cluster,
  env: dict[str, str],
  temp_dir: str,
  *,
  head: int = 0,
  nodes: Sequence[int] | None = None,
  head_cpus: int = 1,
  node_cpus: int = 1,
  port: int = RAY_PORT,
  log=print,
) -> str:
  """A Ray head on host ``head`` and one node on each of ``nodes`` (None: every other host);
  returns the head's ``address:port``.

  Raises:
    RuntimeError: a ``ray start`` failed (its output's tail).
  """
  ray = os.path.join(os.path.dirname(sys.executable), "ray")
  address = cluster.hosts[head].address
  others = [i for i in range(len(cluster.hosts)) if i != head] if nodes is None else nodes
  order = [cluster.hosts[head]] + [cluster.hosts[i] for i in others if i != head]
  for h in order:
    if h.index == head:
      argv = [ray, "start", "--head", f"--port={port}", "--include-dashboard=false"]
      argv += [f"--temp-dir={temp_dir}", f"--num-cpus={head_cpus}"]
    else:
      argv = [ray, "start", f"--address={address}:{port}", f"--num-cpus={node_cpus}"]
    argv += [f"--node-ip-address={h.address}", "--disable-usage-stats"]
    p = cluster.spawn(h.index, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = p.communicate(timeout=180)[0].decode(errors="replace")
    if p.returncode != 0:
      raise RuntimeError(f"`ray start` on host {h.index} failed: {out.strip()[-600:]}")
    log(f"cluster: Ray {'head' if h.index == head else 'node'} on host {h.index} ({h.address})")
  return f"{address}:{port}"


def stop(cluster: Cluster, index: int, *, grace_s: float = 3.0) -> None:
  """Ends every process in host ``index`` (its Ray node and whatever runs beside it)."""
  ns = cluster.hosts[index].ns
  for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
    pids = net.ns_pids(ns)
    for p in pids:
      with contextlib.suppress(ProcessLookupError):
        os.kill(p, sig)
    deadline = time.monotonic() + wait
    while net.ns_pids(ns) and time.monotonic() < deadline:
      time.sleep(0.05)


def host_of(cluster: Cluster, pid: int) -> int | None:
  """The index of the host whose namespace runs process ``pid`` (None: none of them)."""
  for h in cluster.hosts:
    if pid in net.ns_pids(h.ns):
      return h.index
  return None
