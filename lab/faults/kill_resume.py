"""SIGKILL a run at a named fault point, resume it, and check what the resumed run ends with.

Colocated runs are deterministic: the resumed run must end with exactly the parameters of an
uninterrupted run. Disaggregated runs are not (two threads race), so the check is conservation:
offered = consumed + rejected + pending as sets of group ids, no group consumed twice, every
train step logged once, quotas exact per step and mini-batch, and no group started deeper ahead
of the trainer than ``pipeline.max_lag_steps`` allows (`check_bounds`). ``trainer_processes`` is
a disaggregated trainer of two processes (``--distributed``,
`knitjax.distributed.trainer_processes`) with two Ray rollout actors: trials kill trainer process 0
and 1 in turn (the other must stop with one sentence, and both resume), and one more kills a
rollout actor's process mid-run (survived: Ray replaces it, its groups are generated again).

The shape modes (`SHAPES`: ``shape_2to1``, ``shape_1to2``, ``devices_2to4``, ``colocated_2to1``)
resume on another shape: a run of one shape (trainer processes x CPU devices each) is killed
mid-run (process 0 at its fifth update, after a checkpoint) and resumed by the same command with
another number of processes or devices. Every process dumps its shards of each train batch
(`lab.batch_dump`); the check replays those batches from the same initial state in this
process, on the first shape's mesh up to the restored checkpoint and on the second's after it
(`replay_params`), and the resumed run's final train state (parameters and optimizer state) must
equal the replay's (rtol 1e-5, atol 1e-6): the state survived the reshard, and the run trained
on exactly the mini-batches it logged. A disaggregated run must also keep conservation by group
id (`check_disaggregated`).

``supervised`` is a failover: a two-process trainer started by `knitjax.supervise`, trainer
process 1 killed with SIGKILL after step `SUPERVISED_KILL_AFTER`; the supervisor must restart
the run on the one process left, by itself, which must finish with the invariants held. It
measures the seconds from the kill to the first step the restarted run logs and the wall time
against an unkilled supervised run of the same command.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from knitjax import faultpoints
from lab import REPO, local_processes, without_device_count

# Small runs that checkpoint every step, so that a kill anywhere has something to resume from:
# (config file, variant, overrides), given to `knitjax.main` as flags.
RUNS = {
  "colocated": (
    "configs/arith_tiny.py",
    "",
    {
      "loop.steps": 4,
      "loop.log_every": 1,
      "checkpoint.every_steps": 1,
      "admission.quotas.arith": 8,
      "admission.minibatches": 2,
      "rollout.group_size": 4,
    },
  ),
  "disaggregated": (
    "configs/arith_disagg.py",
    "quick",
    {"loop.steps": 4, "checkpoint.every_steps": 1},
  ),
  "trainer_processes": (
    "configs/arith_disagg.py",
    "quick",
    {
      "loop.steps": 4,
      "checkpoint.every_steps": 1,
      "mesh.cpu_devices": 2,
      "topology.rollout_workers": 2,
    },
  ),
}
PROCESSES = {"trainer_processes": 2}  # trainer processes per run (--distributed); others: 1
_DISAGG_SHAPE = (
  "configs/arith_disagg.py",
  "quick",
  {
    "loop.steps": 4,
    "checkpoint.every_steps": 1,
    "mesh.cpu_devices": 1,
    "topology.rollout_workers": 1,  # a Ray rollout: a trainer of several processes needs one
  },
)
RUNS.update(
  shape_2to1=_DISAGG_SHAPE,
  shape_1to2=_DISAGG_SHAPE,
  devices_2to4=RUNS["colocated"],
  colocated_2to1=RUNS["colocated"],  # no Ray: the quickest change of the process count
)
# Resume on another shape: ((trainer processes, CPU devices each) before, the same after).
SHAPES = {
  "shape_2to1": ((2, 1), (1, 1)),
  "shape_1to2": ((1, 1), (2, 1)),
  "devices_2to4": ((1, 2), (1, 4)),
  "colocated_2to1": ((2, 1), (1, 1)),
}
RUNS["supervised"] = (
  "configs/arith_disagg.py",
  "quick",
  {
    "loop.steps": 12,
    "checkpoint.every_steps": 1,
    "mesh.cpu_devices": 1,
    "topology.rollout_workers": 1,
  },
)
SUPERVISED_KILL_AFTER = 4  # the step metrics.jsonl must show before trainer process 1 is killed
SHAPE_KILL = "update:5"  # process 0, in the first train step after checkpoint 2 was started


def _argv(run) -> list[str]:
  path, variant, overrides = run
  return [f"--config={path}{':' + variant if variant else ''}"] + [
    f"--config.{k}={v}" for k, v in overrides.items()
  ]


def _config(run):
  """The ConfigDict of ``run``, as `knitjax.main` builds it from the same flags."""
  import runpy

  path, variant, overrides = run
  c = runpy.run_path(os.path.join(REPO, path))["get_config"](variant or None)
  for key, value in overrides.items():
    *parents, leaf = key.split(".")
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def _env(env: dict[str, str]) -> dict[str, str]:
  env = {**os.environ, "PYTHONPATH": REPO, **env}
  for key in ("KNITJAX_KILL_AT", "KNITJAX_FAULT_COUNTS"):
    if key not in env or not env[key]:
      env.pop(key, None)
  return env


def _main(args: list[str], workdir: str, env: dict[str, str], timeout: float = 900):
  """Runs the trainer; returns its completed process."""
  cmd = [sys.executable, "-m", "knitjax.main", *args, f"--workdir={workdir}"]
  return subprocess.run(
    cmd, cwd=REPO, env=_env(env), capture_output=True, text=True, timeout=timeout
  )


# How a surviving trainer process stops when another dies: a follower lost is noticed by the
# others' pulse watch (`knitjax.distributed.coordination.PulseWatch`, one sentence, exit 1); process
# 0 lost takes the coordination service with it, and JAX's runtime in the others aborts at once
# with its own line (and a stack trace; jaxlib 0.10 gives Python no way to replace it).
JAX_ABORT = "Terminating process because the JAX distributed service detected fatal errors"


def _stopped_by(code: int, err: str) -> str | None:
  """``"pulse"`` or ``"jax_runtime"``: how a surviving trainer process stopped (None: it did not
  stop as either)."""
  if code == 1 and _last_line(err).startswith("error: trainer process"):
    return "pulse"
  if code == -signal.SIGABRT and JAX_ABORT in err:
    return "jax_runtime"
  return None


def _last_line(text: str) -> str:
  lines = [line for line in text.strip().splitlines() if line.strip()]
  return lines[-1] if lines else ""


def actor_pids(kind: str, within: Callable[[int], bool] | None = None) -> list[int]:
  """Processes of Ray actors of class ``kind`` (Ray titles them ``ray::<Class>...``) for which
  ``within(pid)`` holds; by default those descended from this process (the Ray it started), so
  that another Ray on the machine (someone else's tests) is never touched."""
  import psutil

  if within is None:
    me = os.getpid()

    def within(pid: int) -> bool:
      try:
        return any(p.pid == me for p in psutil.Process(pid).parents())
      except psutil.Error:
        return False

  out = []
  for p in psutil.process_iter(["pid", "cmdline"]):
    cmd = " ".join(p.info["cmdline"] or [])
    if cmd.startswith(f"ray::{kind}") and within(p.info["pid"]):
      out.append(p.info["pid"])
  return sorted(out)


def _kill_rollout_actor_after_first_step(workdir: str, killed: list) -> None:
  """A thread: once the run logged a train step, SIGKILLs one Ray rollout actor process."""
  import threading

  def loop():
    deadline = time.time() + 600
    while time.time() < deadline and not killed:
      if _jsonl(os.path.join(workdir, "metrics.jsonl")):
        pids = actor_pids("_RolloutActor")
        if pids:
          os.kill(pids[0], signal.SIGKILL)
          killed.append(pids[0])
          return
      time.sleep(0.2)

  threading.Thread(target=loop, daemon=True).start()


def run_processes(workdir: str, mode: str, *, kills: int, rng, log=print) -> dict:
  """Kill-resume trials of a trainer spread over processes (see the module docstring)."""
  args, steps = _argv(RUNS[mode]), RUNS[mode][2]["loop.steps"]
  n = PROCESSES[mode]
  ref = os.path.join(workdir, mode, "reference")
  files = [os.path.join(workdir, mode, f"counts.p{k}.json") for k in range(n)]
  t0 = time.time()
  result = local_processes.launch(args, ref, [{"KNITJAX_FAULT_COUNTS": f} for f in files])
  if any(code != 0 for code, _ in result):
    raise RuntimeError(f"the {mode} reference run failed: {[_last_line(e) for _, e in result]}")
  counts = []
  for f in files:
    with open(f) as fh:
      counts.append(json.load(fh))
  log(f"[kill-resume] {mode}: reference run {time.time() - t0:.0f} s, points passed {counts}")
  trials = []
  for k in range(kills + 1):
    t0 = time.time()
    wd = os.path.join(workdir, mode, f"kill{k}")
    if k == kills:  # the last trial: a rollout actor's process
      killed: list = []
      first = local_processes.launch(
        args,
        wd,
        [{}] * n,
        on_start=functools.partial(_kill_rollout_actor_after_first_step, wd, killed),
      )
      point, target, n_at, survivors = "rollout_actor", -1, 1, []
      problems = [] if killed else ["no rollout actor process was found to kill"]
      if any(code != 0 for code, _ in first):
        problems.append(f"the run did not survive it: {[_last_line(e) for _, e in first]}")
      else:
        problems += check_disaggregated(wd, steps, RUNS[mode])
    else:
      target = k % n
      points = [p for p in faultpoints.POINTS if counts[target].get(p)]
      point = points[(k // n) % len(points)]
      # The first half of the passes: a rerun passes the rollout's points a varying number of times.
      n_at = int(rng.integers(1, max(1, counts[target][point] // 2) + 1))
      envs = [{"KNITJAX_KILL_AT": f"{point}:{n_at}"} if j == target else {} for j in range(n)]
      first = local_processes.launch(args, wd, envs)
      problems = []
      if first[target][0] != -signal.SIGKILL:
        problems.append(f"process {target} was not killed as planned (exit {first[target][0]})")
      for j, (code, err) in enumerate(first):
        if j != target and _stopped_by(code, err) is None:
          problems.append(f"process {j} did not stop as planned: {code} {_last_line(err)!r}")
      survivors = [_stopped_by(c, e) for j, (c, e) in enumerate(first) if j != target]
      second = local_processes.launch(args, wd, [{}] * n)
      if any(code != 0 for code, _ in second):
        problems.append(f"resume failed: {[_last_line(e) for _, e in second]}")
      else:
        problems += check_disaggregated(wd, steps, RUNS[mode])
    ok = not problems
    trials.append(
      {
        "point": point,
        "process": target,
        "n": n_at,
        "survivors_stopped_by": survivors,
        "ok": ok,
        "problems": problems,
        "seconds": time.time() - t0,
      }
    )
    where = "a rollout actor" if target < 0 else f"process {target} at {point}:{n_at}"
    log(f"[kill-resume] {mode} #{k}: kill {where} -> {'ok' if ok else problems}")
  return {"ok": sum(t["ok"] for t in trials), "trials": trials, "points_passed": counts}


def _launch_shape(args, workdir, shape, dumps, kill: str = ""):
  """Runs ``args`` as a trainer of ``shape`` (processes, devices each) through `lab.batch_dump`
  (each process's shards of every train batch into ``dumps``), ``kill`` armed in process 0.
  Returns each process's ``(exit code, stderr)``."""
  n, devices = shape
  args = [*args, f"--config.mesh.cpu_devices={devices}", f"--dump_batches={dumps}"]
  envs = [{"KNITJAX_KILL_AT": kill}] + [{}] * (n - 1)
  if n > 1:
    return local_processes.launch(
      args, workdir, [{k: v for k, v in e.items() if v} for e in envs], module="lab.batch_dump"
    )
  cmd = [sys.executable, "-m", "lab.batch_dump", *args, f"--workdir={workdir}"]
  env = without_device_count(_env(envs[0]))  # the config's cpu_devices, not this process's
  p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  return [(p.returncode, p.stderr)]


def run_shape(workdir: str, mode: str, log=print) -> dict:
  """One resume on another shape (`SHAPES`; see the module docstring)."""
  run = RUNS[mode]
  before, after = SHAPES[mode]
  args, steps = _argv(run), run[2]["loop.steps"]
  wd = os.path.join(workdir, mode, "run")
  dumps = [os.path.join(workdir, mode, f"batches.{k}") for k in (1, 2)]
  t0 = time.time()
  first = _launch_shape(args, wd, before, dumps[0], kill=SHAPE_KILL)
  problems, figures = [], {}
  if first[0][0] != -signal.SIGKILL:
    problems.append(f"process 0 was not killed as planned (exit {first[0][0]})")
  t1 = time.time()
  second = _launch_shape(args, wd, after, dumps[1])
  t2 = time.time()
  if any(code != 0 for code, _ in second):
    problems.append(f"resume failed: {[_last_line(e) for _, e in second]}")
  else:
    if before != after and "resharded onto" not in second[0][1]:
      problems.append("the resumed run did not log the reshard of its checkpoint")
    if run[0].endswith("arith_disagg.py"):
      problems += check_disaggregated(wd, steps, run)
    else:
      rows = _jsonl(os.path.join(wd, "metrics.jsonl"))
      if [r["step"] for r in rows] != list(range(1, steps + 1)):
        problems.append(f"metrics steps {[r['step'] for r in rows]}")
    if not problems:
      more, figures = compare_replay(wd, run, dumps, before, after)
      problems += more
      ids = [g for c in _jsonl(os.path.join(wd, "consumed.jsonl")) for g in c["group_ids"]]
      if ids:  # disaggregated: each group consumed once
        figures.update(groups_consumed=len(ids), distinct=len(set(ids)))
  ok = not problems
  trial = {
    **figures,
    "before": before,
    "after": after,
    "ok": ok,
    "problems": problems,
    "seconds": [t1 - t0, t2 - t1],
  }
  log(f"[kill-resume] {mode}: {before} -> {after} -> {'ok' if ok else problems}")
  return {"ok": int(ok), "trials": [trial]}


def _supervise(args: list[str], workdir: str, processes: int = 2) -> subprocess.Popen:
  os.makedirs(workdir, exist_ok=True)
  cmd = [sys.executable, "-m", "knitjax.supervise", f"--processes={processes}", "--", *args]
  err = open(os.path.join(workdir, "supervisor.stderr"), "w")  # noqa: SIM115 (kept by the child)
  return subprocess.Popen(
    [*cmd, f"--workdir={workdir}"],
    cwd=REPO,
    env=without_device_count(_env({})),  # each process takes the config's cpu_devices
    stdout=subprocess.DEVNULL,
    stderr=err,
  )


def _trainer_pid(supervisor: int, process_id: int) -> int | None:
  import psutil

  for child in psutil.Process(supervisor).children():
    with_id = f"--process_id={process_id}"
    if with_id in child.cmdline():
      return child.pid
  return None


def run_supervised(
  workdir: str, log=print, *, run=None, kill_after: int = SUPERVISED_KILL_AFTER, reference=True
) -> dict:
  """The ``supervised`` failover (see the module docstring): its figures and problems.

  ``run``: another `RUNS` entry to supervise (a colocated one runs without Ray: the quick test);
  ``reference``: also time an unkilled run of the same command first."""
  run = RUNS["supervised"] if run is None else run
  args, steps = _argv(run), run[2]["loop.steps"]
  ref_code, ref_wall = 0, None
  if reference:
    t0 = time.time()
    ref = _supervise(args, os.path.join(workdir, "supervised", "reference"))
    ref_code = ref.wait(timeout=900)
    ref_wall = time.time() - t0
  wd = os.path.join(workdir, "supervised", "killed")
  metrics = os.path.join(wd, "metrics.jsonl")
  t0 = time.time()
  sup = _supervise(args, wd)
  problems, t_kill, t_restart, t_first, restored, cut = [], None, None, None, None, False
  try:
    deadline = time.time() + 900
    while time.time() < deadline and sup.poll() is None:
      try:
        rows = _jsonl(metrics)
      except ValueError:  # a line being written; read it at the next poll
        time.sleep(0.05)
        continue
      if t_kill is None and rows and rows[-1]["step"] >= kill_after:
        pid = _trainer_pid(sup.pid, 1)
        if pid is not None:
          os.kill(pid, signal.SIGKILL)
          t_kill = time.time()
      elif t_kill is not None and restored is None:
        with open(os.path.join(wd, "supervisor.stderr")) as f:
          said = [line for line in f if "restart 1 of" in line]
        if said:
          restored = int(said[0].split("from checkpoint ")[1].split()[0])
          t_restart = time.time()
      elif restored is not None and not cut:
        cut = not rows or rows[-1]["step"] <= restored  # the restarted run cut the log back
      elif cut and any(r["step"] == restored + 1 for r in rows):
        t_first = time.time()
        break
      time.sleep(0.05)
    code = sup.wait(timeout=max(1.0, deadline - time.time()))
  finally:
    if sup.poll() is None:
      sup.kill()
  wall = time.time() - t0
  with open(os.path.join(wd, "supervisor.stderr")) as f:
    err = f.read()
  restarts = [line.strip() for line in err.splitlines() if "knitjax.supervise: restart" in line]
  if "Traceback (most recent call last)" in err:
    problems.append("a trainer process stopped with a traceback, not one sentence")
  if ref_code != 0:
    problems.append(f"the unkilled supervised run exited {ref_code}")
  if t_kill is None:
    problems.append("trainer process 1 was not found to kill")
  if code != 0:
    problems.append(f"the supervised run did not finish by itself (exit {code})")
  if len(restarts) != 1:
    problems.append(f"{len(restarts)} restart lines, not 1")
  if not problems and run[0].endswith("arith_disagg.py"):
    problems += check_disaggregated(wd, steps, run)
  elif not problems:
    rows = _jsonl(metrics)
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
      problems.append(f"metrics steps {[r['step'] for r in rows]}")
  result = {
    "ok": int(not problems),
    "problems": problems,
    "restart_lines": restarts,
    "restored_checkpoint": restored,
    "seconds_kill_to_restart": None if t_restart is None else t_restart - t_kill,
    "seconds_kill_to_first_step": None if t_first is None else t_first - t_kill,
    "wall_s": wall,
    "wall_s_unkilled": ref_wall,
  }
  log(f"[kill-resume] supervised: {json.dumps(result)}")
  return {"ok": int(not problems), "trials": [result]}


def _replay_batch(folder: str, step: int, index: int) -> dict[str, np.ndarray]:
  """The global train batch of mini-batch (step, index), from every process's shards."""
  import glob

  out: dict[str, np.ndarray] = {}
  for path in sorted(glob.glob(os.path.join(folder, f"{step}-{index}.p*.npz"))):
    with np.load(path) as z:
      for name in z.files:
        key, n, *what = name.split("|")
        if what == ["data"]:
          target = out.setdefault(key, np.zeros(tuple(z[f"{key}|shape"]), z[name].dtype))
          target[tuple(slice(a, b) for a, b in z[f"{key}|{n}|index"])] = z[name]
  return out


def replay_params(run, dumps: list[str], shapes, resumed_at: int, total: int):
  """``(state of an uninterrupted replay, its learner)``: the dumped batches applied from the
  initial state, steps before ``resumed_at`` on ``shapes[0]``'s mesh (``dumps[0]``), the rest
  on ``shapes[1]``'s (``dumps[1]``), the state moved between the two meshes as a restore does.
  Each phase lays batches out as its run did: a trainer of several processes never shares a
  prompt prefix (`knitjax.runtime.layout_choice.prompt_sharing_mode`), so its phase is replayed
  with ``layout.prompt_sharing="off"``. Needs as many devices here as the larger shape has."""
  import jax

  from knitjax.config import from_config_dict
  from knitjax.runtime import builder
  from knitjax.runtime.layout_choice import build_layout
  from knitjax.train.layouts import shardings as layout_shardings

  state, learner = None, None
  scratch = tempfile.mkdtemp(prefix="replay")
  for phase, (n, d) in enumerate(shapes):
    c = _config(run)
    if n > 1:
      c.layout.prompt_sharing = "off"
    config = from_config_dict(c)
    m = config.admission.minibatches
    mesh = builder.build_mesh(config, devices=jax.devices()[: n * d])
    prompt_len = builder.build_prompts(config).prompt_len
    _, learner = builder.build_learner(config, mesh, scratch, prompt_len=prompt_len)
    if state is not None:
      learner.state = jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), state, learner.state)
    layout = build_layout(config, mesh, prompt_len)
    on = layout_shardings(layout, mesh, vlm=False)
    steps = range(0, resumed_at) if phase == 0 else range(resumed_at, total)
    with jax.set_mesh(mesh):
      for step in steps:
        for j in range(m):
          batch = _replay_batch(dumps[phase], step, j)
          if not batch:
            raise RuntimeError(f"no dumped batch of mini-batch {(step, j)} in {dumps[phase]}")
          batch = jax.device_put(batch, {k: on[k] for k in batch})
          learner.state, _ = learner._update(learner.state, batch)
    state = learner.state
  return state, learner


def compare_replay(workdir: str, run, dumps: list[str], before, after) -> tuple[list, dict]:
  """The resumed run's final train state (parameters and optimizer state) against
  `replay_params`' (rtol 1e-5, atol 1e-6): ``(problems, figures)``."""
  import jax

  from knitjax.train.checkpoint import Checkpointer

  steps = run[2]["loop.steps"]
  second = {int(f.split("-")[0]) for f in os.listdir(dumps[1]) if f.endswith(".npz")}
  resumed_at = min(second) if second else steps
  if resumed_at == 0:
    return ["the resumed run started from step 0: no checkpoint was restored"], {}
  state, learner = replay_params(run, dumps, (before, after), resumed_at, steps)
  ckpt = Checkpointer(workdir)
  restored, _ = ckpt.restore(state)
  ckpt.close()
  learner.close()
  pairs = list(zip(*(jax.tree.leaves(jax.device_get(x)) for x in (restored, state)), strict=True))
  pairs = [(np.asarray(a, np.float64), np.asarray(b, np.float64)) for a, b in pairs]
  # |a - b| / (atol + rtol |b|): at most 1 where np.allclose(rtol=1e-5, atol=1e-6) holds.
  worst = max(
    float(np.max(np.abs(a - b) / (1e-6 + 1e-5 * np.abs(b)), initial=0.0)) for a, b in pairs
  )
  figures = {
    "resumed_at_step": resumed_at,
    "arrays": len(pairs),
    "max_abs_diff": max(float(np.max(np.abs(a - b), initial=0.0)) for a, b in pairs),
    "tolerance_used": worst,
  }
  if worst <= 1.0:
    return [], figures
  return [f"final train state differs from the replay (resumed at step {resumed_at})"], figures


def _jsonl(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _latest_meta(workdir: str) -> dict:
  folder = os.path.join(workdir, "checkpoints")
  step = max(int(n) for n in os.listdir(folder) if n.isdigit())
  with open(os.path.join(folder, str(step), "meta", "metadata")) as f:
    return json.load(f)


def _params(workdir: str, run):
  """The parameters of a run's newest checkpoint, as host arrays."""
  import jax

  from knitjax.config import from_config_dict
  from knitjax.runtime import builder
  from knitjax.train.checkpoint import Checkpointer

  config = from_config_dict(_config(run))
  mesh = builder.build_mesh(config)
  _, state, *_ = builder.init_state(config, mesh)
  ckpt = Checkpointer(workdir)
  restored, _ = ckpt.restore(state)
  ckpt.close()
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(restored.params))]


def check_colocated(workdir: str, reference: str, run, steps: int) -> list[str]:
  problems = []
  rows = _jsonl(os.path.join(workdir, "metrics.jsonl"))
  if [r["step"] for r in rows] != list(range(1, steps + 1)):
    problems.append(f"metrics steps {[r['step'] for r in rows]}")
  got, want = _params(workdir, run), _params(reference, run)
  if any(not np.array_equal(a, b) for a, b in zip(got, want, strict=True)):
    problems.append("final params differ from the uninterrupted run")
  return problems


def check_disaggregated(workdir: str, steps: int, run=None) -> list[str]:
  """What a disaggregated run must end with, however often it was stopped and resumed: every
  train step logged once, no group consumed twice, offered = consumed + rejected + pending +
  lost (``lost.jsonl``: given up with a storage unit, each once, never consumed) as sets of
  group ids, no quota violation or lost group in the metrics; and, given its ``run``
  (a `RUNS` entry), the quotas of every step and mini-batch and the pipeline-depth bound
  (`check_bounds`)."""
  problems = []
  rows = _jsonl(os.path.join(workdir, "metrics.jsonl"))
  if [r["step"] for r in rows] != list(range(1, steps + 1)):
    problems.append(f"metrics steps {[r['step'] for r in rows]}")
  consumed = _jsonl(os.path.join(workdir, "consumed.jsonl"))
  offered = _jsonl(os.path.join(workdir, "offered.jsonl"))
  ids = [g for c in consumed for g in c["group_ids"]]
  if len(ids) != len(set(ids)):
    problems.append("a group was consumed twice")
  final = _latest_meta(workdir)
  pending = [g["group_id"] for g in final["admission"]["open"]]
  pending += [g["group_id"] for _, g in final["admission"]["waiting"]]
  pending += [g["group_id"] for mb in final["queued"] for g in mb["groups"]]
  rejected = [o["group_id"] for o in offered if o["rejected"]]
  # given up with their storage unit (a node gone for good), one row each
  lost = [r["group_id"] for r in _jsonl(os.path.join(workdir, "lost.jsonl"))]
  if len(lost) != len(set(lost)):
    problems.append("a lost group was logged twice")
  if set(lost) & set(ids + pending):
    problems.append("a group logged lost was consumed or is pending")
  if sorted(ids + rejected + pending + lost) != sorted(o["group_id"] for o in offered):
    problems.append("offered != consumed + rejected + pending + lost as sets of group ids")
  if any(r.get("quota_violations", 0) for r in rows) or rows and rows[-1].get("groups_lost", 0):
    problems.append("quota violations or lost groups in metrics")
  if run is not None:
    from knitjax.config import from_config_dict

    config = from_config_dict(_config(run))
    lost_rows = _jsonl(os.path.join(workdir, "lost.jsonl"))
    problems += check_bounds(consumed, offered, config.admission, config.pipeline, lost_rows)
  return problems


def check_bounds(
  consumed: list[dict], offered: list[dict], admission, pipeline, lost: list[dict] = ()
) -> list[str]:
  """The quotas of every train step and mini-batch (``consumed.jsonl``), and the pipeline-depth
  bound of `knitjax.rollout.versions` at every group's start (``offered.jsonl``).

  Group ids are given in start order, so a group's id ranks it among the groups started before
  it; counting only those never rejected gives at most the count the bound was checked against
  (started minus rejected so far). The rollout starts a group only on weights at least as new as
  the version its limit was computed from, so the group's gen version (the oldest it used) gives
  the limit: ``rank < start_limit(gen_version)``, else the group started deeper ahead of the
  trainer than ``pipeline.max_lag_steps`` allows. Groups ``lost`` with their storage unit are not
  ranked (the rollout stops counting them when they are lost, so this is the weaker check there).
  """
  from knitjax.rollout import versions

  problems = []
  b, m = admission.groups_per_step, admission.minibatches
  steps: dict[int, Counter] = {}
  for mb in consumed:
    counts = Counter(mb["classes"])
    steps.setdefault(mb["step"], Counter()).update(counts)
    for cls in admission.quotas:
      low = admission.min_per_minibatch.get(cls, 0)
      high = admission.max_per_minibatch.get(cls, b // m)
      if not low <= counts[cls] <= high:
        problems.append(
          f"step {mb['step']} mini-batch {mb['index']} holds {counts[cls]} {cls} groups, "
          f"outside {low}..{high}"
        )
    if len(mb["classes"]) != b // m:
      problems.append(
        f"step {mb['step']} mini-batch {mb['index']} holds {len(mb['classes'])} groups"
      )
  for step, counts in sorted(steps.items()):
    if dict(counts) != {c: q for c, q in admission.quotas.items() if q}:
      problems.append(f"step {step} consumed {dict(counts)}, quotas {dict(admission.quotas)}")
  lag = versions.lag_groups(pipeline.max_lag_steps, groups_per_step=b, minibatches=m)
  latest = {o["group_id"]: o for o in offered}  # a resumed run offers a group once more at most
  gone = {r["group_id"] for r in lost}  # the bound stops counting a lost group (regenerated)
  accepted = sorted(g for g, o in latest.items() if not o["rejected"] and g not in gone)
  over = []
  for rank, gid in enumerate(accepted):
    version = latest[gid]["gen_version"]
    limit = versions.start_limit(
      version, groups_per_step=b, minibatches=m, lag_groups=lag, lag_unit=pipeline.lag_unit
    )
    if rank >= limit:
      over.append(f"group {gid} (started {rank + 1}th, gen version {version}, limit {limit})")
  if over:
    problems.append(
      f"{len(over)} groups started beyond the pipeline-depth bound (max_lag_steps="
      f"{pipeline.max_lag_steps}): {', '.join(over[:3])}"
    )
  return problems


def staleness(consumed: list[dict]) -> dict:
  """The largest staleness and architectural staleness (staleness minus the mini-batch index)
  of the consumed groups."""
  gaps = [(c["consume_version"] - g, c["index"]) for c in consumed for g in c["gen_versions"]]
  return {
    "max_staleness": max((s for s, _ in gaps), default=None),
    "max_arch_staleness": max((max(0, s - j) for s, j in gaps), default=None),
  }


def run(
  workdir: str,
  *,
  kills: int = 10,
  seed: int = 0,
  modes=("colocated", "disaggregated"),
  log=print,
) -> dict:
  """``kills`` kill-resume trials per mode; returns per-trial records and k/``kills`` per mode."""
  rng = np.random.default_rng(seed)
  out = {}
  for mode in modes:
    if mode == "supervised":
      out[mode] = run_supervised(workdir, log=log)
      continue
    if mode in SHAPES:
      out[mode] = run_shape(workdir, mode, log=log)
      continue
    if mode in PROCESSES:
      out[mode] = run_processes(workdir, mode, kills=kills, rng=rng, log=log)
      continue
    args, steps = _argv(RUNS[mode]), RUNS[mode][2]["loop.steps"]
    ref = os.path.join(workdir, mode, "reference")
    counts_file = os.path.join(workdir, mode, "counts.json")
    os.makedirs(ref, exist_ok=True)
    t0 = time.time()
    proc = _main(args, ref, {"KNITJAX_FAULT_COUNTS": counts_file})
    if proc.returncode != 0:
      raise RuntimeError(f"the {mode} reference run failed: {proc.stderr[-2000:]}")
    with open(counts_file) as f:
      counts = json.load(f)
    log(f"[kill-resume] {mode}: reference run {time.time() - t0:.0f} s, points passed {counts}")
    points = [p for p in faultpoints.POINTS if counts.get(p)]
    trials = []
    for k in range(kills):
      point = points[k % len(points)]
      n = int(rng.integers(1, counts[point] + 1))
      wd = os.path.join(workdir, mode, f"kill{k}")
      t0 = time.time()
      first = _main(args, wd, {"KNITJAX_KILL_AT": f"{point}:{n}"})
      killed = first.returncode == -signal.SIGKILL
      second = _main(args, wd, {})
      problems = []
      if not killed:
        tail = first.stderr.strip().splitlines()[-1:]
        problems.append(f"the run was not killed as planned (exit {first.returncode}, {tail})")
      if second.returncode != 0:
        problems.append(f"resume failed: {second.stderr.strip().splitlines()[-1:]}")
      else:
        problems += (
          check_colocated(wd, ref, RUNS[mode], steps)
          if mode == "colocated"
          else check_disaggregated(wd, steps, RUNS[mode])
        )
      ok = not problems
      trials.append(
        {"point": point, "n": n, "ok": ok, "problems": problems, "seconds": time.time() - t0}
      )
      log(f"[kill-resume] {mode} #{k}: kill at {point}:{n} -> {'ok' if ok else problems}")
    out[mode] = {"ok": sum(t["ok"] for t in trials), "trials": trials, "points_passed": counts}
  return out
