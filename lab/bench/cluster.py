"""The paper's claims measured across an emulated cluster (see docs/cluster.md).

``python -m lab.bench --config configs/bench/cluster.py --workdir DIR`` builds hosts as
network namespaces with shaped links and their own cores (`lab.cluster.hosts`): a trainer
host, a storage host (the rollout's storage units) and a controller host (the centralized
baseline's driver), joined as one Ray cluster over their own addresses. Then:

1. **Calibration**: the multimodal benchmark (configs/bench/multimodal.py's ``cluster``
   variant, one process on the trainer host) runs with the links unshaped; its centralized
   compute seconds per row on the trainer's core give the dilation against the named real
   workload (`lab.cluster.scale`).
2. **Multimodal transfer**: the same benchmark with every link shaped to the real link rate /
   dilation, ``repeats`` runs at the headline rate and one at each rate of the sweep. Payloads
   cross the shaped links: storage host -> trainer host (on demand), storage host -> controller
   -> trainer host (centralized).

3. **Staleness**: the real staleness benchmark (configs/bench/staleness_real.py,
   ``staleness_variant``) in a cluster of its own: the trainer (a Ray head with no CPUs) and a
   Ray node holding the rollout actor and its storage unit on hosts of one core each, a
   colocated run on a host of both cores, links at the dilated rate. The simulator predicts
   each of its points.

Writes ``DIR/cluster.json`` (the dilation and its inputs, each run, the headline figures; the
claims not measured yet are null with the reason) and ``DIR/cluster.png``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from lab import REPO, without_device_count
from lab.bench.report import format_table, write_json
from lab.cluster import net, ray_nodes, scale
from lab.cluster.hosts import Cluster, HostSpec

TRAINER, STORAGE, CONTROLLER = 0, 1, 2


def _multimodal(cluster: Cluster, config, env, address: str, workdir: str, log) -> dict:
  """One multimodal benchmark run on the trainer host; returns its JSON."""
  argv = [sys.executable, "-m", "lab.bench"]
  argv += ["--config", f"configs/bench/multimodal.py:{config.multimodal_variant}"]
  argv += ["--workdir", workdir, f"--config.ray_address={address}"]
  argv += [f"--config.unit_nodes={cluster.hosts[STORAGE].address}"]
  argv += [f"--config.driver_node={cluster.hosts[CONTROLLER].address}"]
  result = os.path.join(workdir, "multimodal.json")
  if config.reuse_runs and os.path.exists(result):
    log(f"cluster: reusing {result}")
    with open(result) as f:
      return json.load(f)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "log.txt"), "w") as f:
    p = cluster.spawn(TRAINER, argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
      code = p.wait(timeout=config.run_timeout_s)
    except subprocess.TimeoutExpired:
      p.kill()
      raise RuntimeError(
        f"the multimodal run in {workdir} took over {config.run_timeout_s} s; see its log.txt."
      ) from None
  if code != 0:
    with open(os.path.join(workdir, "log.txt")) as f:
      tail = f.read()[-1500:]
    raise RuntimeError(f"the multimodal run in {workdir} exited {code}: {tail}")
  with open(os.path.join(workdir, "multimodal.json")) as f:
    return json.load(f)


def _figures(mm: dict) -> dict:
  """Per workload of one multimodal run: the two headline figures and the step's parts."""
  out = {}
  for r in mm["results"]:
    c, o = r["centralized"], r["on_demand"]
    out[r["workload"]["name"]] = {
      "latency_ratio": r["latency_ratio"],
      "speedup": r["speedup"],
      "centralized_step_s": c["step_s"],
      "centralized_transfer_s": c["step_transfer_s"],
      "on_demand_step_s": o["step_s"],
      "on_demand_transfer_s": o["step_transfer_s"],
      "bytes_per_step": {"centralized": c["bytes_per_step"], "on_demand": o["bytes_per_step"]},
      "counts": {"centralized": c["counts"], "on_demand": o["counts"]},
    }
  return out


def _die_with_parent() -> None:
  """In the child: SIGKILL when this bench dies (a kill -9 included), so its cluster's reaper
  tears down what the child built."""
  import ctypes

  ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _staleness(config, rate_mbit: float, workdir: str, log) -> dict | None:
  """The real staleness benchmark (configs/bench/staleness_real.py, ``staleness_variant``) with
  its runs in an emulated cluster of their own (trainer, Ray node of the rollout actor,
  colocated: one host each, links at ``rate_mbit``); returns its headline figures and learning,
  or None when not asked."""
  if not config.staleness_variant:
    return None
  argv = [sys.executable, "-m", "lab.bench"]
  argv += ["--config", f"configs/bench/staleness_real.py:{config.staleness_variant}"]
  argv += ["--workdir", workdir, f"--config.cluster_link_mbit={rate_mbit}"]
  argv += [f"--config.reuse_runs={config.reuse_runs}"]
  argv += list(config.staleness_flags)
  env = without_device_count(os.environ)
  env["PYTHONPATH"] = REPO
  os.makedirs(workdir, exist_ok=True)
  log(f"cluster: staleness runs in {workdir} (links at {rate_mbit:.0f} Mbit/s)")
  with open(os.path.join(workdir, "log.txt"), "w") as f:
    p = subprocess.run(
      argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
    )
  if p.returncode != 0:
    with open(os.path.join(workdir, "log.txt")) as f:
      raise RuntimeError(f"the staleness runs in {workdir} failed: {f.read()[-1500:]}")
  with open(os.path.join(workdir, "staleness_real.json")) as f:
    st = json.load(f)
  with open(os.path.join(workdir, "learning.json")) as f:
    learn = json.load(f)
  return {
    "weight_sync": _weight_sync(os.path.join(workdir, "runs")),
    "cut_matched": st["reduction"],
    "cut_equal": st["reduction_equal_config"],
    "throughput_gain": st["throughput_gain"],
    "disaggregated_over_colocated_throughput": st["disaggregated_over_colocated_throughput"],
    "policies": st["policies"],
    "checks": st["checks"],
    "sim_max_rel_error": st["max_abs_rel_error"],
    "predicted": st["predicted"],
    "learning": learn,
    "command": " ".join(argv),
  }


def _weight_sync(runs_dir: str) -> dict | None:
  """Seconds and bytes per published version of each disaggregated run (its ``timings.json``).

  With Ray rollout actors the run times the publish on the trainer's side (dispatch to the copy
  complete, ``weight_publish_s_mean``); the actor's pull of the version from Ray's object store
  across the link is not timed, so the figure is a lower bound on the link's share.
  """
  per_run = {}
  for name in sorted(os.listdir(runs_dir)):
    path = os.path.join(runs_dir, name, "timings.json")
    if os.path.exists(path):
      with open(path) as f:
        t = json.load(f)
      if t.get("weight_publish_bytes_mean"):
        per_run[name] = {
          "seconds": t["weight_publish_s_mean"],
          "bytes": t["weight_publish_bytes_mean"],
        }
  if not per_run:
    return None
  seconds = sorted(r["seconds"] for r in per_run.values())
  return {
    "seconds": seconds[len(seconds) // 2],
    "bytes": next(iter(per_run.values()))["bytes"],
    "per_run": per_run,
    "timed": "the trainer's publish (dispatch to copy complete); the actor's pull is not timed",
  }


def _naive_s_per_row(mm: dict) -> float:
  main = mm["main"]
  w = main["workload"]
  return main["centralized"]["step_compute_s"] / (w["groups_per_step"] * w["group_size"])


def _multimodal_config(variant: str):
  import importlib.util

  path = os.path.join(REPO, "configs", "bench", "multimodal.py")
  spec = importlib.util.spec_from_file_location("_multimodal_bench_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


def _by_trainer_hosts(config, real, env: dict, workdir: str, log) -> dict | None:
  """The multimodal comparison with T trainer processes, each on a trainer host of its own
  (`lab.bench.multimodal_hosts`), for every T of ``config.trainer_hosts``; None when empty."""
  from lab.bench import multimodal_hosts as mmh

  if not config.trainer_hosts:
    return None
  mm = _multimodal_config(config.multimodal_variant)
  cores = mmh.host_cores(max(config.trainer_hosts), *config.host_cores[:2])
  out = {
    "hosts": [list(c) for c in cores],
    "goal": {"trainer_hosts": 4, "speedup": 5.8, "latency_ratio": 100.0},
  }
  with Cluster([HostSpec(cores=c) for c in cores], log=log) as cluster:
    temp_dir = ray_nodes.private_temp_dir(cluster.tag, "h")
    try:
      address = ray_nodes.start(cluster, env, f"{temp_dir}/ray", head=TRAINER, log=log)
      for t in config.trainer_hosts:
        r = mmh.run(
          cluster, mm, real, env, address, t, os.path.join(workdir, f"hosts{t}"),
          rounds=config.trainer_host_rounds, timeout_s=config.run_timeout_s, log=log,
        )  # fmt: skip
        if t == out["goal"]["trainer_hosts"]:
          r["goal_met"] = {
            "speedup": min(r["speedup"]) >= out["goal"]["speedup"],
            "latency_ratio": min(r["latency_ratio"]) >= out["goal"]["latency_ratio"],
          }
        out[str(t)] = r
    finally:
      shutil.rmtree(temp_dir, ignore_errors=True)
  return out


LOCK_FILE = "knitjax-cluster-bench.lock"  # in the temp folder: one cluster benchmark at a time


@contextlib.contextmanager
def one_at_a_time(root: str | None = None):
  """Holds an exclusive lock (``flock`` of ``TMP/LOCK_FILE``, released when the process ends,
  kill -9 included) for the benchmark's duration; raises ValueError (one sentence) while another
  process holds it: two runs at once share the machine's cores, and each measures a different
  dilation."""
  path = os.path.join(root or tempfile.gettempdir(), LOCK_FILE)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
      raise ValueError(
        f"another cluster benchmark is running (pid {holder}, holding {path}); wait for it to "
        "end: two at once share the cores and would measure different dilations."
      ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    yield
  finally:
    os.close(fd)  # releases the lock


def run(config, workdir: str) -> dict:
  if problem := net.missing_tools():
    raise ValueError(problem)
  with one_at_a_time():
    return _run(config, workdir)


def _run(config, workdir: str) -> dict:
  workdir = os.path.abspath(workdir)
  real = scale.RealWorkload(**dict(config.real))
  log = lambda m: print(m, flush=True)  # noqa: E731
  env = ray_nodes.ray_env(workdir)
  specs = [HostSpec(cores=tuple(cores)) for cores in config.host_cores]
  t0 = time.time()
  runs, d = [], None
  if config.one_trainer_host:
    runs, d = _one_trainer_host(config, real, env, specs, workdir, log)
  by_hosts = _by_trainer_hosts(config, real, env, workdir, log)
  if d is None and by_hosts and "1" in by_hosts:
    d = by_hosts["1"]["dilation"]  # one trainer host's, measured by the hosts runs
  staleness = d and _staleness(config, d["link_mbit"], os.path.join(workdir, "staleness"), log)
  headline = [r for r in runs if r["real_gbps"] == real.link_gbps]
  out = {
    "bench": "cluster",
    "hosts": [list(c) for c in config.host_cores],
    "dilation": d,
    "multimodal": {
      "real_gbps": real.link_gbps,
      "latency_ratio": [r["figures"]["main"]["latency_ratio"] for r in headline],
      "speedup": [r["figures"]["main"]["speedup"] for r in headline],
      "pipelined": {
        k: [r["figures"].get("pipelined", {}).get(k) for r in headline]
        for k in ("latency_ratio", "speedup")
      },
      "runs": runs,
      "by_trainer_hosts": by_hosts,
    },
    "staleness": staleness,
    "weight_sync": staleness and staleness["weight_sync"],
    "sim_max_rel_error": staleness and staleness["sim_max_rel_error"],
    "wall_s": time.time() - t0,
  }
  write_json(workdir, "cluster", out)
  if runs:
    _plot(runs, os.path.join(workdir, "cluster.png"))
    rows = [
      {
        "real Gb/s": r["real_gbps"] or "unshaped",
        "link Mbit/s": r["link_mbit"] or 0.0,
        **{
          f"{k} {name}": f[k]
          for name, f in r["figures"].items()
          for k in ("latency_ratio", "speedup", "centralized_transfer_s")
        },
      }
      for r in runs
    ]
    print(format_table(rows, list(rows[0])))
  if by_hosts:
    _plot_hosts(by_hosts, os.path.join(workdir, "cluster_hosts.png"))
    print(format_table(_hosts_rows(by_hosts), list(_hosts_rows(by_hosts)[0])))
  return out


def _hosts_rows(by_hosts: dict) -> list[dict]:
  """One table row per T and round."""
  rows = []
  for key, r in by_hosts.items():
    if not key.isdigit():
      continue
    for i, (s, lr) in enumerate(zip(r["speedup"], r["latency_ratio"], strict=True)):
      f = r[f"round{i}"]
      rows.append(
        {
          "T": r["trainer_hosts"],
          "round": i,
          "D/host": r["dilation"]["factor"],
          "link Mbit/s": r["link_mbit"],
          "speedup": s,
          "latency_ratio": lr,
          "cen xfer s": f["centralized"]["step_transfer_s"],
          "cen comp s": f["centralized"]["step_compute_s"],
          "od xfer s": f["on_demand"]["step_transfer_s"],
          "od comp s": f["on_demand"]["step_compute_s"],
        }
      )
  return rows


def _one_trainer_host(config, real, env, specs, workdir: str, log):
  """The one-trainer-host runs: calibration, then the headline rate and the sweep."""
  with Cluster(specs, log=log) as cluster:
    temp_dir = ray_nodes.private_temp_dir(cluster.tag, "")
    try:
      address = ray_nodes.start(cluster, env, f"{temp_dir}/ray", head=TRAINER, log=log)
      calib = _multimodal(cluster, config, env, address, os.path.join(workdir, "calibrate"), log)
      d = scale.dilation(real, _naive_s_per_row(calib))
      log(
        f"cluster: dilation {d['factor']:.1f} (emulated {d['emulated_naive_s_per_row'] * 1e3:.2f} "
        f"ms/row, {real.name} {d['real']['naive_s'] * 1e3:.3f} ms/row): "
        f"{real.link_gbps} Gb/s -> {d['link_mbit']:.0f} Mbit/s per link"
      )
      runs = [{"real_gbps": None, "link_mbit": None, "figures": _figures(calib)}]
      plan = [real.link_gbps] * config.repeats
      plan += [g for g in config.sweep_gbps if g != real.link_gbps]
      for i, gbps in enumerate(plan):
        rate = scale.link_mbit(gbps, d["factor"])
        cluster.shape(rate)
        log(f"cluster: run {i + 1}/{len(plan)}: links at {rate:.0f} Mbit/s ({gbps} Gb/s real)")
        mm = _multimodal(cluster, config, env, address, os.path.join(workdir, f"mm{i}"), log)
        runs.append({"real_gbps": gbps, "link_mbit": rate, "figures": _figures(mm)})
    finally:
      shutil.rmtree(temp_dir, ignore_errors=True)
  return runs, d


def _plot(runs: list[dict], path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  shaped = sorted((r for r in runs if r["real_gbps"]), key=lambda r: r["real_gbps"])
  if not shaped:
    return
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for name in shaped[0]["figures"]:
    g = [r["real_gbps"] for r in shaped]
    for ax, key in zip(axes, ("speedup", "latency_ratio"), strict=True):
      ax.plot(g, [r["figures"][name][key] for r in shaped], "o-", label=name)
  for ax, key in zip(axes, ("transfer+train speedup", "latency ratio"), strict=True):
    ax.set_xscale("log")
    ax.set_xlabel("real link Gb/s per host (emulated at rate / dilation)")
    ax.set_ylabel(key)
    ax.legend()
  axes[1].set_yscale("log")
  fig.suptitle("centralized + naive vs on-demand + dedup across the emulated cluster")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _plot_hosts(by_hosts: dict, path: str) -> None:
  """Speedup and latency ratio against T, every round a point, the goals dashed."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  goal = by_hosts["goal"]
  for ax, key in zip(axes, ("speedup", "latency_ratio"), strict=True):
    for k, r in by_hosts.items():
      if k.isdigit():
        ax.plot([r["trainer_hosts"]] * len(r[key]), r[key], "o", color="C0")
    ax.axhline(goal[key], color="k", lw=0.8, ls="--", label=f"goal at T={goal['trainer_hosts']}")
    ax.set_xlabel("trainer hosts T (each at its per-host dilation)")
    ax.set_ylabel(key.replace("_", " "))
    ax.set_xscale("log", base=2)
    ax.legend()
  axes[1].set_yscale("log")
  fig.suptitle("centralized + naive vs on-demand + dedup, T trainer hosts")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
