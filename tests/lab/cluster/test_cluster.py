"""The emulated cluster: its names and commands (pure), its errors, and, where this machine has
root and iproute2, a real one: two hosts with shaped links joined as one Ray cluster, a trainer on
one and its rollout actor on the other's Ray node, for two steps, then nothing of it left; and
nothing left after a kill -9 of its owner.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from lab.cluster import net
from lab.cluster.hosts import Cluster, HostSpec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


MISSING = net.cannot_build()
needs_root = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def test_names_fit_linux_interface_names_and_parse_back():
  tag = net.tag_of(4194304)  # the largest pid Linux gives
  assert tag == "kj4194304"
  assert len(net.veth_name(tag, 99)) <= 15 and len(net.bridge_name(tag)) <= 15
  assert net.NS_RE.match(net.ns_name(tag, 3)).groups() == ("4194304", "3")
  assert net.host_address(44, 1) == "10.213.44.11" and net.bridge_address(44) == "10.213.44.1"


def test_stale_tags_are_the_namespaces_of_dead_owners():
  names = ["kj10h0", "kj10h1", "kj11h0", "other", "kj12h0x"]
  assert net.stale_tags(names, alive=lambda pid: pid == 11) == ["kj10"]


def test_a_free_subnet_skips_those_in_use():
  assert net.free_subnet(43, set()) == 44
  assert net.free_subnet(43, {44, 45}) == 46
  with pytest.raises(RuntimeError, match="every subnet"):
    net.free_subnet(0, set(range(1, 251)))


def test_shaping_commands():
  assert net.tbf("kj1v0", 1000.0) == [
    *("tc", "qdisc", "replace", "dev", "kj1v0", "root", "tbf", "rate", "1000.0mbit"),
    *("burst", "65536", "latency", "200ms"),
  ]
  assert net.tbf("eth0", 1.0, ns="kj1h0")[:5] == ["ip", "netns", "exec", "kj1h0", "tc"]
  assert net.loss_rule("kj1h0", 0.01)[-8:] == [
    *("-m", "statistic", "--mode", "random", "--probability", "0.01", "-j", "DROP")
  ]
  assert net.block_rule("kj1h0", "10.213.1.11", add=False)[4:7] == ["iptables", "-D", "OUTPUT"]


def test_missing_root_or_tools_is_one_sentence(monkeypatch):
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  assert net.missing_tools() == (
    "the emulated cluster needs root (network namespaces, veth links and tc need it)."
  )
  monkeypatch.setattr(os, "geteuid", lambda: 0)
  monkeypatch.setattr(net.shutil, "which", lambda t: None if t in ("tc", "iptables") else t)
  assert net.missing_tools() == "the emulated cluster needs tc: apt-get install iproute2."
  assert net.missing_tools(need_iptables=True) == (
    "the emulated cluster needs tc, iptables: apt-get install iproute2 iptables."
  )
  with pytest.raises(RuntimeError, match="needs tc: apt-get install iproute2"):
    Cluster([HostSpec(cores=(0,))]).start()


def test_host_spec_and_cluster_errors():
  with pytest.raises(ValueError, match="give one or more core numbers"):
    HostSpec(cores=())
  with pytest.raises(ValueError, match="must be > 0"):
    HostSpec(cores=(0,), rate_mbit=0)
  with pytest.raises(ValueError, match=r"this machine has 0\.\."):
    Cluster([HostSpec(cores=(4096,))])


@needs_root
def test_a_kill_9_of_the_owner_leaves_no_namespace():
  code = (
    "import time\n"
    "from lab.cluster.hosts import Cluster, HostSpec\n"
    "c = Cluster([HostSpec(cores=(0,)), HostSpec(cores=(0,))]); c.start()\n"
    "c.spawn(1, ['sleep', '600'])\n"
    "print('up', flush=True); time.sleep(600)\n"
  )
  p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
  assert p.stdout.readline().startswith("cluster: 2 hosts")
  assert p.stdout.readline() == "up\n"
  tag = net.tag_of(p.pid)
  assert len(net.own_namespaces(tag)) == 2
  sleeper = net.ns_pids(net.ns_name(tag, 1))
  assert sleeper
  p.kill()
  p.wait()
  deadline = time.monotonic() + 20
  bridge = f"/sys/class/net/{net.bridge_name(tag)}"
  # the reaper removes the namespaces, then the bridge: wait for both (a loaded machine is slow)
  while (net.own_namespaces(tag) or os.path.exists(bridge)) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert net.own_namespaces(tag) == []
  assert not os.path.exists(f"/sys/class/net/{net.bridge_name(tag)}")
  for pid in sleeper:
    assert not os.path.exists(f"/proc/{pid}") or net._zombie(pid)


@needs_root
def test_trainer_and_a_ray_node_run_two_steps_across_two_shaped_hosts(tmp_path):
  from lab.cluster import ray_nodes
  from lab.faults import kill_resume

  workdir = tmp_path / "run"
  env = ray_nodes.ray_env(str(tmp_path))
  lines, placed = [], {}
  with Cluster(
    [HostSpec(cores=(0,), rate_mbit=200.0), HostSpec(cores=(1,), rate_mbit=200.0)],
    log=lines.append,
  ) as cluster:
    trainer = cluster.hosts[0]
    temp_dir = f"/tmp/ray_{cluster.tag}"
    address = ray_nodes.start(cluster, env, temp_dir, head_cpus=0, log=lines.append)
    base = [sys.executable, "-m", "knitjax.main", "--config", "configs/arith_disagg.py:quick"]
    base += ["--workdir", str(workdir), "--config.topology.rollout_workers=1"]
    base += ["--config.mesh.cpu_devices=2", "--config.topology.rollout_devices=1"]
    base += ["--config.loop.steps=2", f"--config.topology.ray_address={address}"]
    log_path = tmp_path / "train.log"
    with open(log_path, "w") as log:
      proc = cluster.spawn(0, base, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
      deadline = time.monotonic() + 300
      while proc.poll() is None and time.monotonic() < deadline:
        for kind in ("_RolloutActor", "_StorageActor"):
          ours = lambda pid: ray_nodes.host_of(cluster, pid) is not None  # noqa: E731
          if kind not in placed and (pids := kill_resume.actor_pids(kind, ours)):
            placed[kind] = [ray_nodes.host_of(cluster, p) for p in pids]
        time.sleep(0.2)
      code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
      if proc.poll() is None:
        proc.kill()
      subprocess.run(["rm", "-rf", temp_dir])
    qdiscs = net.sh(*net.in_ns(trainer.ns, "tc", "qdisc", "show", "dev", "eth0"))
    tag = cluster.tag
  out = log_path.read_text()
  assert code == 0, out[-3000:]
  assert re.match(r"cluster: 2 hosts: kj\d+h0 10\.213\.\d+\.10 cores 0 200.0 Mbit/s", lines[-3])
  assert lines[-2:] == [
    f"cluster: Ray head on host 0 ({trainer.address})",
    f"cluster: Ray node on host 1 ({trainer.address.rsplit('.', 1)[0]}.11)",
  ]
  assert "tbf" in qdiscs and "rate 200Mbit" in qdiscs
  # the head offers no CPUs: the rollout actor and its storage unit ran on the other host
  assert placed == {"_RolloutActor": [1], "_StorageActor": [1]}, placed
  consumed = [json.loads(x) for x in (workdir / "consumed.jsonl").read_text().splitlines()]
  assert [r["step"] for r in consumed] == [0, 0, 1, 1]
  ids = [g for r in consumed for g in r["group_ids"]]
  assert len(ids) == len(set(ids))
  assert net.own_namespaces(tag) == []
