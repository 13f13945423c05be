"""The emulated cluster's Linux plumbing: names, `ip`/`tc`/`iptables` commands, stale teardown.

Every object a cluster makes carries its tag, ``kj<owner pid>``: the namespaces
``kj<pid>h<i>`` (one per host), the bridge ``kj<pid>br`` and the bridge-side veth ends
``kj<pid>v<i>`` (the host-side end, inside the namespace, is ``eth0``). The tag is what a
later start uses to find a cluster whose owner died without tearing it down (`stale_tags`),
and what `teardown` removes: every process inside the namespaces, the namespaces, the bridge.

The functions that build commands are pure (tested without root); `sh` runs one.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time

PREFIX = "kj"
NS_RE = re.compile(rf"^{PREFIX}(\d+)h(\d+)$")
BRIDGE_RE = re.compile(rf"^{PREFIX}(\d+)br$")
SUBNET_BASE = "10.213"  # a cluster's hosts are 10.213.<k>.<10 + i>/24, its bridge .1


def tag_of(pid: int) -> str:
  return f"{PREFIX}{pid}"


def ns_name(tag: str, i: int) -> str:
  return f"{tag}h{i}"


def bridge_name(tag: str) -> str:
  return f"{tag}br"


def veth_name(tag: str, i: int) -> str:
  return f"{tag}v{i}"


def host_address(k: int, i: int) -> str:
  return f"{SUBNET_BASE}.{k}.{10 + i}"


def bridge_address(k: int) -> str:
  return f"{SUBNET_BASE}.{k}.1"


def missing_tools(need_iptables: bool = False) -> str | None:
  """One sentence naming what this machine lacks for a cluster, or None."""
  if os.geteuid() != 0:
    return "the emulated cluster needs root (network namespaces, veth links and tc need it)."
  tools = ["ip", "tc", "taskset"] + (["iptables"] if need_iptables else [])
  lacking = [t for t in tools if shutil.which(t) is None]
  if lacking:
    pkg = {"ip": "iproute2", "tc": "iproute2", "taskset": "util-linux", "iptables": "iptables"}
    pkgs = " ".join(sorted({pkg[t] for t in lacking}))
    return f"the emulated cluster needs {', '.join(lacking)}: apt-get install {pkgs}."
  return None


def cannot_build() -> str | None:
  """Why this machine cannot build a cluster (root and tools, then a namespace tried), or None."""
  if problem := missing_tools():
    return problem
  probe = f"{PREFIX}probe{os.getpid()}"
  made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
  if made.returncode != 0:
    return f"this machine cannot make a network namespace: {made.stderr.strip()}"
  subprocess.run(["ip", "netns", "del", probe], capture_output=True)
  return None


def sh(*argv: str, check: bool = True) -> str:
  """Runs one command; a failure raises RuntimeError naming the command and its stderr."""
  r = subprocess.run(argv, capture_output=True, text=True)
  if check and r.returncode != 0:
    raise RuntimeError(f"`{' '.join(argv)}` failed: {r.stderr.strip() or r.returncode}")
  return r.stdout


def in_ns(ns: str, *argv: str) -> list[str]:
  return ["ip", "netns", "exec", ns, *argv]


def tbf(dev: str, rate_mbit: float, *, ns: str | None = None) -> list[str]:
  """A token-bucket shaper on ``dev``'s egress at ``rate_mbit``.

  The bucket holds 64 KiB (one full-size segment), so a message passes at the link rate from
  its first bytes: a 300 KB weight version at 1,119 Mbit/s takes 2.1 ms, as the rate says (a
  bucket of 10 ms at the rate let it through at the veth's own speed). It queues up to 200 ms.
  """
  burst = 64 * 1024
  cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf"]
  cmd += ["rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "200ms"]
  return in_ns(ns, *cmd) if ns else cmd


def netem(dev: str, *, delay_ms: float, jitter_ms: float, ns: str | None = None) -> list[str]:
  cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "netem", "delay", f"{delay_ms}ms"]
  if jitter_ms:
    cmd.append(f"{jitter_ms}ms")
  return in_ns(ns, *cmd) if ns else cmd


def loss_rule(ns: str, probability: float, *, add: bool = True) -> list[str]:
  """Drops each outgoing packet of the host with ``probability`` (iptables' statistic match)."""
  op = "-A" if add else "-D"
  rule = ["-m", "statistic", "--mode", "random", "--probability", f"{probability}", "-j", "DROP"]
  return in_ns(ns, "iptables", op, "OUTPUT", "-o", "eth0", *rule)


def block_rule(ns: str, address: str, *, add: bool = True) -> list[str]:
  """Drops every packet the host sends to ``address`` (one side of a partition)."""
  return in_ns(ns, "iptables", "-A" if add else "-D", "OUTPUT", "-d", address, "-j", "DROP")


def namespaces() -> list[str]:
  out = sh("ip", "netns", "list", check=False)
  return [line.split()[0] for line in out.splitlines() if line.strip()]


def own_namespaces(tag: str) -> list[str]:
  return sorted(
    (ns for ns in namespaces() if (m := NS_RE.match(ns)) and f"{PREFIX}{m[1]}" == tag),
    key=lambda ns: int(NS_RE.match(ns)[2]),
  )


def pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def stale_tags(names: list[str], alive=pid_alive) -> list[str]:
  """The tags among namespace ``names`` whose owner process is gone."""
  pids = sorted({int(m[1]) for n in names if (m := NS_RE.match(n))})
  return [tag_of(p) for p in pids if not alive(p)]


def ns_pids(ns: str) -> list[int]:
  out = sh("ip", "netns", "pids", ns, check=False)
  return [int(x) for x in out.split() if x.isdigit()]


def teardown(tag: str, *, grace_s: float = 3.0) -> None:
  """Ends every process in ``tag``'s namespaces (TERM, then KILL after ``grace_s``), removes the
  namespaces (their veth ends go with them) and the bridge. Safe to call twice."""
  spaces = own_namespaces(tag)
  for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
    pids = [p for ns in spaces for p in ns_pids(ns)]
    for p in pids:
      with contextlib.suppress(ProcessLookupError):
        os.kill(p, sig)
    deadline = time.monotonic() + wait
    while pids and time.monotonic() < deadline:
      pids = [p for p in pids if pid_alive(p) and not _zombie(p)]
      time.sleep(0.05)
  for ns in spaces:
    sh("ip", "netns", "del", ns, check=False)
  if os.path.exists(f"/sys/class/net/{bridge_name(tag)}"):
    sh("ip", "link", "del", bridge_name(tag), check=False)
  deadline = time.monotonic() + 5.0  # the kernel removes a namespace's veth pairs after it goes
  while _links(tag) and time.monotonic() < deadline:
    time.sleep(0.05)


def _links(tag: str) -> list[str]:
  kinds = ("v", "b", "p")  # veth, bridge, veth peer
  return [
    n for n in os.listdir("/sys/class/net") if n[: len(tag)] == tag and n[len(tag) :][:1] in kinds
  ]


def _zombie(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] == "Z"
  except OSError:
    return False


def used_subnets() -> set[int]:
  """The third octets of 10.213.k.0/24 already on an interface of this namespace."""
  out = sh("ip", "-o", "-4", "addr", "show", check=False)
  return {int(m[1]) for m in re.finditer(rf"inet {re.escape(SUBNET_BASE)}\.(\d+)\.", out)}


def free_subnet(pid: int, used: set[int]) -> int:
  for step in range(250):
    k = (pid + step) % 250 + 1
    if k not in used:
      return k
  raise RuntimeError(f"every subnet {SUBNET_BASE}.1-250.0/24 is in use on this machine.")


def netem_available() -> bool:
  """Whether this kernel has the netem qdisc (delay, jitter); tried on a throwaway link."""
  dev = f"{PREFIX}probe{os.getpid() % 100000}"[:13]
  add = ["ip", "link", "add", dev, "type", "veth", "peer", "name", dev + "p"]
  if subprocess.run(add, capture_output=True).returncode != 0:
    return False
  try:
    r = subprocess.run(netem(dev, delay_ms=1, jitter_ms=0), capture_output=True)
    return r.returncode == 0
  finally:
    sh("ip", "link", "del", dev, check=False)
