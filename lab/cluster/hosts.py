"""An emulated cluster on one Linux machine: hosts with their own network stack, link and cores.

```
root namespace:   bridge kj<pid>br 10.213.k.1 ──┬── veth kj<pid>v0 ═╗ (tc: rate[, delay])
                                                ├── veth kj<pid>v1 ═╬═╗
host i:           namespace kj<pid>h<i>, eth0 10.213.k.(10+i), its own cores (taskset)
```

Each host is a network namespace joined to one bridge by a veth pair. Both ends of each pair are
shaped at the host's rate (a token bucket; netem where the kernel has it, for delay and jitter),
so a host sends and receives at most its link rate, like a NIC, and host-to-host traffic crosses
two shaped links as it would cross two NICs and a switch. Processes start inside a host with
`Cluster.spawn` (``ip netns exec``, pinned with ``taskset``); they share the machine's file
system, so a run's workdir is visible to all of them.

Teardown happens on every exit path: `Cluster.close` (and the context manager, and the signals
the bench turns into exits) removes every process, namespace and link the cluster made; a kill -9
of the owner is covered by a reaper, a small process in its own session that holds the read end
of a pipe whose write end only the owner holds: when the owner dies for any reason, the pipe
closes and the reaper tears the cluster down. A later start also removes what a dead owner left
(``stale``), in case the reaper was killed too.

Faults for the fault suite: `set_link` (a host's link down and up), `lossy` (random loss on every
link, iptables' statistic match) and `partition` (two hosts cannot reach each other).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from lab.cluster import net


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostSpec:
  """One host: ``cores`` it is pinned to, and its link's ``rate_mbit`` (None: unshaped)."""

  cores: tuple[int, ...]
  rate_mbit: float | None = None

  def __post_init__(self):
    if not self.cores or any(c < 0 for c in self.cores):
      raise ValueError(f"HostSpec.cores={self.cores!r}: give one or more core numbers.")
    if self.rate_mbit is not None and not self.rate_mbit > 0:
      raise ValueError(f"HostSpec.rate_mbit={self.rate_mbit!r} must be > 0 (None: unshaped).")


@dataclasses.dataclass(frozen=True)
class Host:
  index: int
  ns: str
  address: str
  cores: tuple[int, ...]
  link: str  # the bridge-side end of its veth pair, in the root namespace


class Cluster:
  """H hosts on one machine; use as a context manager (or call `start` and `close`).

  Args:
    hosts: one `HostSpec` per host.
    delay_ms, jitter_ms: one-way delay added on each link's two ends (needs netem).
    log: where progress lines go.
  """

  def __init__(
    self, hosts: Sequence[HostSpec], *, delay_ms: float = 0.0, jitter_ms: float = 0.0, log=print
  ):
    if not hosts:
      raise ValueError("a cluster needs at least one host.")
    cpus = os.cpu_count() or 1
    for i, h in enumerate(hosts):
      if max(h.cores) >= cpus:
        raise ValueError(f"host {i} is pinned to cores {h.cores}; this machine has 0..{cpus - 1}.")
    self.specs, self.delay_ms, self.jitter_ms, self._log = list(hosts), delay_ms, jitter_ms, log
    self.tag = net.tag_of(os.getpid())
    self.hosts: list[Host] = []
    self._reaper: subprocess.Popen | None = None
    self._procs: list[subprocess.Popen] = []

  def __enter__(self) -> Cluster:
    self.start()
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def start(self) -> None:
    if problem := net.missing_tools():
      raise RuntimeError(problem)
    if (self.delay_ms or self.jitter_ms) and not net.netem_available():
      raise RuntimeError(
        "link delay and jitter need the kernel's netem qdisc (sch_netem), which this kernel "
        "lacks; set delay_ms=0 and jitter_ms=0."
      )
    for tag in clear_stale():
      self._log(f"cluster: removed the namespaces of {tag}, whose owner had died")
    if net.own_namespaces(self.tag):  # ours, from an earlier cluster of this process
      net.teardown(self.tag)
    self._reaper = subprocess.Popen(
      [sys.executable, "-m", "lab.cluster.reaper", self.tag],
      stdin=subprocess.PIPE,
      start_new_session=True,
    )
    try:
      self._build()
    except BaseException:
      self.close()
      raise
    shown = ", ".join(
      f"{h.ns} {h.address} cores {','.join(map(str, h.cores))} "
      f"{s.rate_mbit or 'unshaped'}{' Mbit/s' if s.rate_mbit else ''}"
      for h, s in zip(self.hosts, self.specs, strict=True)
    )
    self._log(f"cluster: {len(self.hosts)} hosts: {shown}")

  def _build(self) -> None:
    k = net.free_subnet(os.getpid(), net.used_subnets())
    br = net.bridge_name(self.tag)
    net.sh("ip", "link", "add", br, "type", "bridge")
    net.sh("ip", "addr", "add", f"{net.bridge_address(k)}/24", "dev", br)
    net.sh("ip", "link", "set", br, "up")
    for i, spec in enumerate(self.specs):
      ns, veth, peer = net.ns_name(self.tag, i), net.veth_name(self.tag, i), f"{self.tag}p{i}"
      net.sh("ip", "netns", "add", ns)
      net.sh("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
      net.sh("ip", "link", "set", peer, "netns", ns)
      net.sh("ip", "-n", ns, "link", "set", peer, "name", "eth0")
      net.sh("ip", "link", "set", veth, "master", br)
      net.sh("ip", "link", "set", veth, "up")
      address = net.host_address(k, i)
      net.sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
      net.sh("ip", "-n", ns, "link", "set", "eth0", "up")
      net.sh("ip", "-n", ns, "link", "set", "lo", "up")
      self.hosts.append(Host(i, ns, address, spec.cores, veth))
      if spec.rate_mbit or self.delay_ms or self.jitter_ms:
        self._shape(self.hosts[-1], spec.rate_mbit)

  def _shape(self, host: Host, rate_mbit: float | None) -> None:
    for dev, ns in ((host.link, None), ("eth0", host.ns)):
      if self.delay_ms or self.jitter_ms:
        cmd = net.netem(dev, delay_ms=self.delay_ms, jitter_ms=self.jitter_ms, ns=ns)
        net.sh(*cmd, *(["rate", f"{rate_mbit}mbit"] if rate_mbit else []))
      elif rate_mbit:
        net.sh(*net.tbf(dev, rate_mbit, ns=ns))

  def shape(self, rate_mbit: float | None, hosts: Sequence[int] | None = None) -> None:
    """Sets the link rate of ``hosts`` (all by default); None removes the shaping."""
    for i in range(len(self.hosts)) if hosts is None else hosts:
      self.specs[i] = dataclasses.replace(self.specs[i], rate_mbit=rate_mbit)
      if rate_mbit is None and not (self.delay_ms or self.jitter_ms):
        h = self.hosts[i]
        net.sh("tc", "qdisc", "del", "dev", h.link, "root", check=False)
        net.sh(*net.in_ns(h.ns, "tc", "qdisc", "del", "dev", "eth0", "root"), check=False)
      else:
        self._shape(self.hosts[i], rate_mbit)

  def spawn(self, i: int, argv: Sequence[str], **popen) -> subprocess.Popen:
    """Starts ``argv`` inside host ``i``, pinned to its cores, in a session of its own."""
    h = self.hosts[i]
    cmd = net.in_ns(h.ns, "taskset", "-c", ",".join(map(str, h.cores)), *argv)
    p = subprocess.Popen(cmd, start_new_session=True, **popen)
    self._procs.append(p)
    return p

  def set_link(self, i: int, up: bool) -> None:
    """Takes host ``i``'s link down (packets to and from it are lost) or up again."""
    net.sh("ip", "link", "set", self.hosts[i].link, "up" if up else "down")

  def remove(self, i: int, *, grace_s: float = 0.0) -> None:
    """Removes host ``i`` for good: every process in it killed (SIGKILL unless ``grace_s``) and
    its namespace deleted (its veth pair goes with it); its index stays, its namespace empty."""
    ns = self.hosts[i].ns
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
      if not wait:
        continue
      for p in net.ns_pids(ns):
        with contextlib.suppress(ProcessLookupError):
          os.kill(p, sig)
      deadline = time.monotonic() + wait
      while net.ns_pids(ns) and time.monotonic() < deadline:
        time.sleep(0.05)
    net.sh("ip", "netns", "del", ns, check=False)

  def lossy(self, probability: float, on: bool = True) -> None:
    """Every host drops each packet it sends with ``probability`` (or stops doing so)."""
    self._rule_all([net.loss_rule(h.ns, probability, add=on) for h in self.hosts], on)

  def partition(self, a: int, b: int, on: bool = True) -> None:
    """Hosts ``a`` and ``b`` stop reaching each other (``on=False``: heal)."""
    ha, hb = self.hosts[a], self.hosts[b]
    rules = [net.block_rule(ha.ns, hb.address, add=on), net.block_rule(hb.ns, ha.address, add=on)]
    self._rule_all(rules, on)

  def _rule_all(self, rules: list[list[str]], on: bool) -> None:
    if problem := net.missing_tools(need_iptables=True):
      raise RuntimeError(problem)
    for rule in rules:
      net.sh(*rule, check=on)  # removing a rule that is not there is no error

  def close(self) -> None:
    """Ends every process in the hosts and removes the namespaces and links. Idempotent."""
    for p in self._procs:
      if p.poll() is None:
        p.terminate()
    net.teardown(self.tag)
    for p in self._procs:
      try:
        p.wait(timeout=5)
      except subprocess.TimeoutExpired:
        p.kill()
    if self._reaper is not None:
      self._reaper.stdin.close()  # the reaper finds nothing left and exits
      try:
        self._reaper.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self._reaper.kill()
      self._reaper = None
    self.hosts, self._procs = [], []


def clear_stale() -> list[str]:
  """Tears down every cluster whose owner process is gone; returns their tags."""
  names = net.namespaces()
  bridges = [b[: -len("br")] for b in os.listdir("/sys/class/net") if net.BRIDGE_RE.match(b)]
  tags = net.stale_tags(names + [net.ns_name(t, 0) for t in bridges])
  for tag in tags:
    net.teardown(tag)
  return tags
