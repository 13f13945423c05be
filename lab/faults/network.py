"""Network faults across an emulated cluster: a trainer host and a rollout host whose link fails.

The run is kill_resume's ``rollout_hosts`` run (a trainer process and a rollout host process,
the host holding the storage unit the trainer fetches from), each on a host of its own core in
a `lab.cluster.hosts.Cluster`, the trainer listening on its host's address. Trials:

- ``link_down``: once the first train step is logged, the rollout host's link goes down for
  10 s, then up again (TCP retransmits; the connections outlive it);
- ``loss``: every link drops 1% of the packets it sends, for the whole first attempt;
- ``partition``: once the first train step is logged, the trainer host and the rollout host
  (the storage unit) stop reaching each other, with fetches and reports in flight, until the
  trainer has stopped; both sides must notice (`knitjax.rollout.remote.tuned`: within about
  ``DEAD_PEER_S``) and the trainer must stop with one sentence.

A trial's run either finishes, or stops with one sentence and is resumed (trainer and host
again, the network healed) until it finishes; then `kill_resume.check_disaggregated`: train
steps logged once each, no group consumed twice, offered = consumed + rejected + pending, quotas
exact. Delay and jitter need the kernel's netem, which some kernels lack; the JSON says whether
they were applied.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from knitjax.rollout.remote import DEAD_PEER_S
from lab.cluster import net
from lab.cluster.hosts import Cluster, HostSpec
from lab.faults import kill_resume

TRIALS = ("link_down", "loss", "partition")
STEPS = 6
LINK_MBIT = 1000.0
DOWN_S = 10.0
LOSS = 0.01
JITTER_MS = 50.0


def _argv(listen: str) -> list[str]:
  config, variant, overrides = kill_resume.RUNS["rollout_hosts"]
  overrides = {**overrides, "loop.steps": STEPS, "mesh.cpu_devices": 1}
  overrides["topology.rollout_listen"] = f"{listen}:0"
  return kill_resume._argv((config, variant, overrides))


def _first_step_logged(workdir: str, timeout_s: float = 300) -> bool:
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if os.path.exists(path) and os.path.getsize(path) > 0:
      return True
    time.sleep(0.05)
  return False


def _attempt(cluster: Cluster, args: list[str], workdir: str, fault=None) -> dict:
  """One start of trainer and host (``fault(workdir)`` in a thread beside them)."""
  env = kill_resume._env({}, own_devices=True)
  cmd = [sys.executable, "-m", "knitjax.main", *args, f"--workdir={workdir}"]
  out = {}
  host = cluster.spawn(
    1,
    [*cmd, "--role=rollout"],
    cwd=kill_resume.REPO,
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
  )
  trainer = cluster.spawn(
    0,
    cmd,
    cwd=kill_resume.REPO,
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
  )
  thread = None
  if fault is not None:
    thread = threading.Thread(target=fault, args=(workdir, trainer, out), daemon=True)
    thread.start()
  t0 = time.monotonic()
  try:
    err = trainer.communicate(timeout=900)[1]
    host_err = host.communicate(timeout=DEAD_PEER_S + 60)[1]
  finally:
    for p in (trainer, host):
      if p.poll() is None:
        p.kill()
        p.wait()
  if thread is not None:
    thread.join()
  lines = err.strip().splitlines()
  return {
    **out,
    "trainer_code": trainer.returncode,
    "host_code": host.returncode,
    "last_line": lines[-1] if lines else "",
    "host_last_line": (host_err.strip().splitlines() or [""])[-1],
    "seconds": time.monotonic() - t0,
  }


def _faults(cluster: Cluster, trial: str):
  def link_down(workdir, trainer, out):
    if _first_step_logged(workdir):
      cluster.set_link(1, False)
      out["fault_at_s"] = time.time()
      time.sleep(DOWN_S)
      cluster.set_link(1, True)

  def partition(workdir, trainer, out):
    if _first_step_logged(workdir):
      cluster.partition(0, 1)
      out["fault_at_s"] = time.time()
      while trainer.poll() is None:  # healed once the trainer has stopped
        time.sleep(0.1)
      cluster.partition(0, 1, on=False)

  return {"link_down": link_down, "partition": partition, "loss": None}[trial]


def run(workdir: str, *, trials=TRIALS, log=print) -> dict:
  """Each trial in a fresh 2-host cluster; returns per trial its attempts and the checks."""
  if problem := net.missing_tools(need_iptables=True):
    return {"skipped": problem}
  jitter = net.netem_available()
  out: dict = {
    "jitter_ms": JITTER_MS if jitter else None,
    "jitter_note": None
    if jitter
    else "not applied: this kernel lacks the netem qdisc (delay and jitter need it)",
    "trials": {},
  }
  for trial in trials:
    hosts = [HostSpec(cores=(0,), rate_mbit=LINK_MBIT), HostSpec(cores=(1,), rate_mbit=LINK_MBIT)]
    wd = os.path.join(workdir, trial)
    t0 = time.time()
    delay = {"jitter_ms": JITTER_MS} if trial == "loss" and jitter else {}
    with Cluster(hosts, log=lambda m: None, **delay) as cluster:
      args = _argv(cluster.hosts[0].address)
      if trial == "loss":
        cluster.lossy(LOSS)
      attempts = [_attempt(cluster, args, wd, _faults(cluster, trial))]
      if trial == "loss":
        cluster.lossy(LOSS, on=False)
      while attempts[-1]["trainer_code"] != 0 and len(attempts) < 3:
        attempts.append(_attempt(cluster, args, wd))
    first = attempts[0]
    problems = []
    if first["trainer_code"] not in (0, 1):
      problems.append(f"the faulted run exited {first['trainer_code']}: {first['last_line']!r}")
    if first["trainer_code"] == 1 and "rollout host 0" not in first["last_line"]:
      problems.append(f"the trainer's last line does not name the host: {first['last_line']!r}")
    if attempts[-1]["trainer_code"] != 0:
      problems.append(f"the resumed run failed: {attempts[-1]['last_line']!r}")
    else:
      problems += kill_resume.check_disaggregated(wd, STEPS)
    out["trials"][trial] = {
      "ok": not problems,
      "outcome": "finished" if first["trainer_code"] == 0 else "stopped, resumed",
      "problems": problems,
      "attempts": attempts,
      "seconds": time.time() - t0,
    }
    log(
      f"[network] {trial}: {out['trials'][trial]['outcome']} "
      f"({first['last_line'][:160] if first['trainer_code'] else 'exit 0'}) -> "
      f"{problems or 'ok'}"
    )
  out["ok"] = sum(t["ok"] for t in out["trials"].values())
  return out
