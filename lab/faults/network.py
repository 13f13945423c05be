"""Network faults across an emulated cluster: a trainer host and a Ray node whose link fails.

Two hosts of a `lab.cluster.hosts.Cluster`, one core each, joined as one Ray cluster
(`lab.cluster.ray_nodes`): host 0 runs the Ray head (no CPUs to offer) and the trainer
(`configs/arith_disagg.py:quick`, ``topology.rollout_workers=1``, ``topology.ray_address`` the
head), host 1 a Ray node, where the rollout actor (it asks for a CPU) and its storage unit land;
the trainer fetches its payloads across the link and publishes weights across it. Where the two
actors ran is recorded (``placement``). Trials:

- ``link_down``: once the first train step is logged, host 1's link goes down for ``DOWN_S``,
  then up again;
- ``loss``: every link drops ``LOSS`` of the packets it sends, for the whole first attempt;
- ``partition``: once the first train step is logged, the two hosts stop reaching each other,
  with fetches and weights in flight, until the trainer has stopped;
- ``node_removed``: three hosts, a Ray node on hosts 1 and 2 (``topology.rollout_workers=2``,
  one rollout actor and its storage unit on each); once ``REMOVE_AFTER`` train steps are
  logged, host 2 is removed for good (every process in it killed, its namespace deleted, never
  restored). The run must finish on the worker left, without a restart: the groups host 2's
  unit held are given up (``lost.jsonl``) and generated again. Recorded: the steps logged
  before the removal, the seconds from the removal to the next step logged, the groups lost
  (pending in the index or in reopened released mini-batches) and regenerated.

The trainer gets ``DEADLINE_S`` per attempt: one still running then is recorded as a hang (a
problem), stopped with SIGTERM (SIGKILL if that does not end it) and the network healed. A
trial's run either finishes, or stops (one sentence wanted; a traceback is recorded as a
problem with its last line) and is resumed in a fresh Ray cluster until it finishes; then
`kill_resume.check_disaggregated`: train steps logged once each, no group consumed twice,
offered = consumed + rejected + pending, quotas exact per mini-batch, the version bound held.
Delay and jitter need the kernel's netem, which some kernels lack; the JSON says whether they
were applied.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from lab.cluster import net, ray_nodes
from lab.cluster.hosts import Cluster, HostSpec
from lab.faults import kill_resume

TRIALS = ("link_down", "loss", "partition", "node_removed")
STEPS = 40
LINK_MBIT = 1000.0
DOWN_S = 10.0
LOSS = 0.01
JITTER_MS = 50.0
DEADLINE_S = 360.0  # per attempt: an undisturbed run takes about 90 s, a partition about 240 s
REMOVED_DEADLINE_S = 600.0  # node_removed: two workers on one core, then Ray's node-death checks
TRAINER, NODE = 0, 1
GONE = 2  # node_removed: the host removed for good
REMOVE_AFTER = 8  # node_removed: train steps logged before the removal
ACTORS = ("_RolloutActor", "_StorageActor")


def _run(address: str, workers: int = 1) -> tuple:
  """kill_resume's disaggregated run, its rollout in ``workers`` Ray actors of the cluster at
  ``address``."""
  config, variant, overrides = kill_resume.RUNS["disaggregated"]
  overrides = {
    **overrides,
    "loop.steps": STEPS,
    # the rollout is in the actor: one device trains, one is the (unused) rollout side
    "mesh.cpu_devices": 2,
    "topology.rollout_devices": 1,
    "topology.rollout_workers": workers,
    "topology.ray_address": address,
  }
  return config, variant, overrides


def _steps_logged(workdir: str) -> int:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  with open(path, "rb") as f:
    return f.read().count(b"\n")


def _first_step_logged(
  workdir: str, proc: subprocess.Popen, timeout_s: float = 300, steps: int = 1
) -> bool:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline and proc.poll() is None:
    if _steps_logged(workdir) >= steps:
      return True
    time.sleep(0.05)
  return False


def _placement(cluster: Cluster, proc: subprocess.Popen, out: dict, count: int = 1) -> None:
  """A thread: records the hosts the first ``count`` Ray actors of each kind ran on."""
  seen = out.setdefault("placement", {})
  ours = lambda pid: ray_nodes.host_of(cluster, pid) is not None  # noqa: E731
  while proc.poll() is None and len(seen) < len(ACTORS):
    for kind in ACTORS:
      if kind not in seen and len(pids := kill_resume.actor_pids(kind, ours)) >= count:
        seen[kind] = sorted(ray_nodes.host_of(cluster, p) for p in pids)
    time.sleep(0.3)


def _faults(trial: str):
  def link_down(cluster, workdir, trainer, out):
    if _first_step_logged(workdir, trainer):
      cluster.set_link(NODE, False)
      out["fault_at_s"] = time.time()
      time.sleep(DOWN_S)
      cluster.set_link(NODE, True)

  def loss(cluster, workdir, trainer, out):
    cluster.lossy(LOSS)
    out["fault_at_s"] = time.time()
    while trainer.poll() is None:
      time.sleep(0.1)
    cluster.lossy(LOSS, on=False)

  def partition(cluster, workdir, trainer, out):
    if _first_step_logged(workdir, trainer):
      cluster.partition(TRAINER, NODE)
      out["fault_at_s"] = time.time()
      while trainer.poll() is None:  # healed once the trainer has stopped
        time.sleep(0.1)
      cluster.partition(TRAINER, NODE, on=False)

  def node_removed(cluster, workdir, trainer, out):
    if _first_step_logged(workdir, trainer, steps=REMOVE_AFTER):
      steps = out["steps_before_removal"] = _steps_logged(workdir)
      cluster.remove(GONE)
      out["fault_at_s"] = time.time()
      while trainer.poll() is None and _steps_logged(workdir) <= steps:
        time.sleep(0.05)
      if _steps_logged(workdir) > steps:
        out["removal_to_next_step_s"] = time.time() - out["fault_at_s"]

  faults = {"link_down": link_down, "loss": loss, "partition": partition}
  return {**faults, "node_removed": node_removed}[trial]


def _stop(proc: subprocess.Popen) -> str:
  """SIGTERM (the trainer checkpoints and says where to resume), SIGKILL after 60 s."""
  proc.send_signal(signal.SIGTERM)
  try:
    proc.wait(timeout=60)
    return "SIGTERM"
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
    return "SIGKILL"


def _attempt(
  cluster: Cluster, workdir: str, k: int, fault=None, workers: int = 1, deadline_s=DEADLINE_S
) -> dict:
  """One start of a fresh Ray cluster and the trainer (``fault`` in a thread beside them); the
  hosts' processes are ended afterwards, whatever state the fault left them in."""
  out: dict = {}
  t0 = time.monotonic()
  temp_dir = ray_nodes.private_temp_dir(cluster.tag, f"_{k}")  # owner-only; Ray's folder inside
  env = ray_nodes.ray_env(os.path.join(os.path.dirname(workdir), "ray"))
  err_path = f"{workdir}.attempt{k}.log"
  os.makedirs(os.path.dirname(err_path), exist_ok=True)
  try:
    port = ray_nodes.RAY_PORT + k  # a fresh port: the last head's may linger in TIME_WAIT
    address = ray_nodes.start(
      cluster, env, f"{temp_dir}/ray", head_cpus=0, port=port, log=lambda m: None
    )
    cmd = [sys.executable, "-m", "knitjax.main", *kill_resume._argv(_run(address, workers))]
    with open(err_path, "w") as err:
      trainer = cluster.spawn(
        TRAINER,
        [*cmd, f"--workdir={workdir}"],
        cwd=kill_resume.REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=err,
      )
      threads = [
        threading.Thread(target=_placement, args=(cluster, trainer, out, workers), daemon=True)
      ]
      if fault is not None:
        threads.append(
          threading.Thread(target=fault, args=(cluster, workdir, trainer, out), daemon=True)
        )
      for t in threads:
        t.start()
      try:
        trainer.wait(timeout=deadline_s)
      except subprocess.TimeoutExpired:
        out["hung_after_s"] = time.monotonic() - t0
        out["stopped_by"] = _stop(trainer)
      out["exit_s"] = time.time()
      for t in threads:
        t.join(timeout=DOWN_S + 5)
  finally:
    for h in cluster.hosts:
      ray_nodes.stop(cluster, h.index)  # a removed host's namespace has no process left
    shutil.rmtree(temp_dir, ignore_errors=True)
  with open(err_path) as f:
    text = f.read()
  lines = [line for line in text.strip().splitlines() if line.strip()]
  tb = text.rfind("Traceback (most recent call last)")
  out.update(
    trainer_code=trainer.returncode,
    last_line=lines[-1] if lines else "",
    traceback=text[tb:][-3000:] if tb >= 0 else None,
    log=err_path,
    seconds=time.monotonic() - t0,
  )
  if "fault_at_s" in out:
    out["stopped_after_fault_s"] = out.pop("exit_s") - out["fault_at_s"]
  out.pop("exit_s", None)
  return out


def _judge(first: dict, last: dict, wd: str, nodes=(NODE,)) -> list[str]:
  problems = []
  placed = first.get("placement", {})
  for kind in ACTORS:
    if placed.get(kind) != list(nodes):
      where = f"host {nodes[0]}" if len(nodes) == 1 else f"hosts {list(nodes)}"
      problems.append(f"{kind} ran on hosts {placed.get(kind)}, not on the Ray node's {where}")
  if "hung_after_s" in first:
    problems.append(
      f"the faulted trainer hung: still running {first['hung_after_s']:.0f} s after its start, "
      f"stopped by {first['stopped_by']} (last line {first['last_line'][:200]!r})"
    )
  elif first["trainer_code"] not in (0, 1):
    problems.append(f"the faulted run exited {first['trainer_code']}: {first['last_line']!r}")
  elif first["trainer_code"] == 1 and (
    first["traceback"] is not None or not first["last_line"].startswith("error:")
  ):
    problems.append(f"the faulted run ended in a traceback: {first['last_line'][:300]!r}")
  if last["trainer_code"] != 0:
    problems.append(f"the resumed run failed: {last['last_line']!r}")
  else:
    problems += kill_resume.check_disaggregated(wd, STEPS, _run("", len(nodes)))
  return problems


def _node_removed(first: dict, attempts: list, wd: str) -> tuple[dict, list[str]]:
  """The node_removed trial's figures, and what it must show beyond `_judge`: the run finished
  in its first attempt, on the worker left, with the lost groups given up and generated again."""
  rows = kill_resume._jsonl(os.path.join(wd, "metrics.jsonl"))
  lost = kill_resume._jsonl(os.path.join(wd, "lost.jsonl"))
  last = rows[-1] if rows else {}
  figures = {
    "steps_finished": len(rows),
    "steps_before_removal": first.get("steps_before_removal"),
    "removal_to_next_step_s": first.get("removal_to_next_step_s"),
    "groups_lost": len(lost),
    "groups_lost_pending": sum(r["where"] == "pending" for r in lost),
    "groups_lost_released": sum(r["where"] == "released" for r in lost),
    "lost_units": sorted({r["storage_unit"] for r in lost}),
    # in flight on the removed worker (same ids, made again) plus the lost groups' prompts
    "groups_regenerated": int(last.get("groups_regenerated", 0)),
    "groups_lost_with_node_metric": int(last.get("groups_lost_with_node", 0)),
    "quota_violations": int(last.get("quota_violations", 0)),
  }
  problems = []
  if "fault_at_s" not in first:
    problems.append(f"host {GONE} was never removed (the run ended before step {REMOVE_AFTER})")
  if len(attempts) > 1:
    problems.append("the run did not finish on the worker left: it needed a resume")
  if figures["groups_lost_with_node_metric"] != len(lost):
    problems.append(f"metrics count {figures['groups_lost_with_node_metric']} lost groups, "
                    f"lost.jsonl {len(lost)}")  # fmt: skip
  return figures, problems


def run(workdir: str, *, trials=TRIALS, log=print) -> dict:
  """Each trial in fresh 2-host clusters; returns per trial its attempts and the checks."""
  if problem := net.missing_tools(need_iptables=True):
    return {"skipped": problem}
  jitter = net.netem_available()
  out: dict = {
    "jitter_ms": JITTER_MS if jitter else None,
    "jitter_note": None
    if jitter
    else "not applied: this kernel lacks the netem qdisc (delay and jitter need it)",
    "deadline_s": DEADLINE_S,
    "trials": {},
  }
  for trial in trials:
    wd = os.path.join(workdir, trial, "run")
    t0 = time.time()
    delay = {"jitter_ms": JITTER_MS} if trial == "loss" and jitter else {}
    nodes = (NODE, GONE) if trial == "node_removed" else (NODE,)
    # the trainer on core 0, the Ray nodes on core 1
    specs = [HostSpec(cores=(0,), rate_mbit=LINK_MBIT)]
    specs += [HostSpec(cores=(1,), rate_mbit=LINK_MBIT) for _ in nodes]
    with Cluster(specs, log=lambda m: None, **delay) as cluster:
      deadline = REMOVED_DEADLINE_S if trial == "node_removed" else DEADLINE_S
      attempts = [_attempt(cluster, wd, 0, _faults(trial), len(nodes), deadline)]
      while attempts[-1]["trainer_code"] != 0 and len(attempts) < 3:
        if trial == "node_removed":  # resumed on the host left, with one worker
          cluster.hosts = cluster.hosts[:GONE]
        attempts.append(_attempt(cluster, wd, len(attempts), workers=len(cluster.hosts) - 1))
    first = attempts[0]
    problems = _judge(first, attempts[-1], wd, nodes)
    figures = {}
    if trial == "node_removed":
      figures, more = _node_removed(first, attempts, wd)
      problems += more
    outcome = (
      "finished"
      if first["trainer_code"] == 0
      else "hung, stopped, resumed"
      if "hung_after_s" in first
      else "stopped, resumed"
    )
    out["trials"][trial] = {
      "ok": not problems,
      "outcome": outcome,
      "problems": problems,
      "attempts": attempts,
      **figures,
      **kill_resume.staleness(kill_resume._jsonl(os.path.join(wd, "consumed.jsonl"))),
      "seconds": time.time() - t0,
    }
    shown = first["last_line"][:160] if first["trainer_code"] else "exit 0"
    log(f"[network] {trial}: {outcome} ({shown}) -> {problems or 'ok'}")
  out["ok"] = sum(t["ok"] for t in out["trials"].values())
  return out
