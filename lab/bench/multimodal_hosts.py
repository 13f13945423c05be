"""The multimodal comparison with T trainer hosts, each its own process, host, link and data share.

`lab.bench.multimodal` runs the trainer as one process whose consumers are threads. Here the
trainer is T processes (``python -m lab.bench.multimodal_hosts``), one per emulated trainer host
(`lab.cluster.hosts`: a network namespace with its own shaped link), forming ONE JAX program:
``jax.distributed`` over gloo on the hosts' addresses, one global mesh of T devices (one CPU
device per process), the same jitted multimodal train step. Process ``k`` is consumer ``k``:

- ``on_demand`` + encoder dedup: process ``k`` fetches its own share of each mini-batch (its
  groups, each unique image once, uint8) straight from the storage units (Ray actors on the
  storage host) across its own link, prefetch 1 (`multimodal_modes.OnDemandConsumers`).
- ``centralized`` + naive encoding: one driver (a Ray actor on the controller host) gathers
  every payload of the step from the storage units, builds every row's float32 pixels, and
  scatters each trainer host its contiguous share; every byte crosses the controller's one link,
  out to the T trainer hosts. The first process to ask for a step's share starts its gather.

The workload is weakly scaled: each trainer host trains what the one-host run's trainer trains
(the main workload's groups per step), so a step holds ``T x`` those groups, and the controller
moves ``T x`` the bytes through its one link while every on-demand host moves its own share.

Cores and dilation: the T trainer hosts share the trainer core(s) (``taskset``; with one core,
each gets 1/T of it), storage and controller hosts the other core. Each T is calibrated on its
own: its unshaped phase measures the centralized compute seconds per row *per host* (the step's
wall-clock compute / the rows one host trains), which carries the sharing, and gives the
dilation D_T against one named real trainer host (`lab.cluster.scale`); every link then runs at
the real link rate / D_T. One process launch per T runs: ``calibrate`` (unshaped; its first
steps compile), then ``rounds`` measured rounds at the dilated rate, both modes' steps
interleaved in each. The launcher (`run`, in the bench's process) shapes the links between
phases; the processes wait for its go file (the workdir is shared).

Timing across processes: each process records, per mini-batch, how long it waited for its data
(exposed) and then for the step; the mini-batch's exposed transfer is the slowest host's wait,
its compute the rest of the slowest host's wall time (`combine`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from lab import REPO
from lab.bench import multimodal_modes as modes

TRAINER0, STORAGE, CONTROLLER = 0, 1, 2  # host indices, as in lab.bench.cluster
MODES = ("centralized", "on_demand")
PORT = 8476  # the jax.distributed coordinator's port, on trainer host 0


# ----- pure parts: hosts, cores, shares, dilation, combining the processes' timings -----


def host_cores(max_trainers: int, trainer_cores=(0,), service_cores=(1,)) -> list[tuple]:
  """Cores of every host: 0 trainer 0, 1 storage, 2 controller, 3.. trainers 1..max-1."""
  if max_trainers < 1:
    raise ValueError(f"trainer_hosts must be >= 1, got {max_trainers}.")
  t, s = tuple(trainer_cores), tuple(service_cores)
  return [t, s, s] + [t] * (max_trainers - 1)


def trainer_hosts(t: int) -> list[int]:
  """Host indices of trainer processes 0..t-1."""
  return [TRAINER0] + [3 + i for i in range(t - 1)]


def core_share(t: int, trainer_cores=(0,)) -> dict:
  """How the T trainer processes share the trainer cores (each pinned to all of them)."""
  return {
    "trainer_cores": list(trainer_cores),
    "trainer_processes": t,
    "core_fraction_per_trainer_host": len(trainer_cores) / t,
  }


def hosts_workload(config, t: int):
  """The main workload with T hosts' groups per step (weak scaling: each host's share is the
  one-host workload's step)."""
  from lab.bench.multimodal_workload import Workload

  base = dict(config.workload)
  per_host = base["groups_per_step"]
  if per_host % base["minibatches"]:
    raise ValueError(
      f"{per_host} groups per host per step do not split into {base['minibatches']} mini-batches."
    )
  return Workload(name=f"main_T{t}", **{**base, "groups_per_step": per_host * t})


def rows_per_host(w, t: int) -> int:
  return w.groups_per_step * w.group_size // t


def per_host_dilation(real, centralized_step_compute_s: float, rows: int) -> dict:
  """The dilation of one trainer host: its measured compute seconds per row (centralized,
  unshaped, while sharing its core) against one real trainer host's."""
  from lab.cluster import scale

  return scale.dilation(real, centralized_step_compute_s / rows)


def combine(per_process: list[list[dict]]) -> list[dict]:
  """Per mini-batch, the rows of the T processes as one: exposed = the slowest host's wait,
  compute = the rest of the slowest host's wall time, transfer = the slowest fetch; counts as
  the step reported them (global), unique images summed over hosts."""
  out = []
  for rs in zip(*per_process, strict=True):
    exposed = max(r["exposed_s"] for r in rs)
    wall = max(r["exposed_s"] + r["compute_s"] for r in rs)
    out.append(
      {
        **rs[0],
        "transfer_s": max(r["transfer_s"] for r in rs),
        "exposed_s": exposed,
        "compute_s": wall - exposed,
        "release_to_compute_s": max(r["release_to_compute_s"] for r in rs),
        "unique_images": sum(r["unique_images"] for r in rs),
      }
    )
  return out


def figures(w, steps: int, per_process: list[dict], steps_groups: dict) -> dict:
  """One phase's figures from every process's record (``rows`` per mode, ``bytes``; process 0's
  ``sizes``): both modes' summaries, ``latency_ratio`` and ``speedup``."""
  from lab.bench.multimodal import _check_counts, _summary

  out = {}
  for mode in MODES:
    rows = combine([p["rows"][mode] for p in per_process])
    want = [[_Groups(g) for g in step] for step in steps_groups[mode]]
    counts = _check_counts(mode, rows, want, w)
    if mode == "centralized":
      sizes = per_process[0]["sizes"]
      total = sum(sum(z["received"].values()) + sum(z["sent"].values()) for z in sizes)
      total /= len(sizes)
      by = {"controller": total}  # every byte goes into the controller and out again
    else:
      by = {f"trainer_host{k}": p["bytes"] for k, p in enumerate(per_process)}
      total = sum(by.values())
    out[mode] = {**_summary(rows, steps), "counts": counts, "bytes": total, "bytes_by_host": by}
  c, o = out["centralized"], out["on_demand"]
  out["latency_ratio"] = c["exposed_mean_s"] / max(o["exposed_mean_s"], 1e-9)
  out["speedup"] = c["step_s"] / o["step_s"]
  return out


class _Groups:
  """A measured mini-batch as `_check_counts` reads it (its groups' ids)."""

  def __init__(self, ids):
    self.groups = [_Id(g) for g in ids]


class _Id:
  def __init__(self, gid):
    self.group_id = gid


# ----- the trainer processes -----


class SharedDriver(modes.Driver):
  """The single controller serving T trainer hosts: the first host to ask for a step's share
  gathers the whole step (`Driver.gather`); each host takes its share across the controller's
  link. A threaded actor (``max_concurrency`` >= T), so the others wait on the lock meanwhile."""

  def __init__(self, storage, row_spec, consumers: int, row_format: str):
    super().__init__(storage, row_spec, consumers, row_format)
    self._lock, self._key, self._sizes = threading.Lock(), None, None

  def part(self, key, minibatches, consumer: int):
    with self._lock:
      if key != self._key:
        self._sizes, self._key = self.gather(minibatches), key
      parts = self._parts.pop(consumer)
    return parts, self._sizes


class _Discard:
  """A storage unit that keeps nothing: the other processes derive the same group metadata."""

  def put(self, *args, **kwargs):
    return 0


def _own_hostname(address: str) -> None:
  """Gloo binds to this process's hostname's address (127.0.0.1 here): a UTS namespace of the
  process's own, named after its host's address, makes it bind to the host's link."""
  import ctypes

  libc = ctypes.CDLL("libc.so.6", use_errno=True)
  if libc.unshare(0x04000000) != 0:  # CLONE_NEWUTS
    raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS) failed (needs root)")
  name = address.encode()
  if libc.sethostname(name, len(name)) != 0:
    raise OSError(ctypes.get_errno(), "sethostname failed")


def _say(k: int, what: str) -> None:
  print(f"trainer process {k}: {what}", flush=True)


def _wait_file(path: str, timeout: float) -> None:
  deadline = time.time() + timeout
  while not os.path.exists(path):
    if time.time() > deadline:
      raise TimeoutError(f"no {path} after {timeout:.0f} s.")
    time.sleep(0.05)


def _centralized_step(state, fn, mbs, driver, k, micro, device, shardings):
  """One step through the shared driver (this host's share), as `modes.centralized_step`."""
  import jax
  import ray

  from knitjax.train.step import host_metrics

  t_release = time.perf_counter()
  parts, sizes = ray.get(driver.part.remote(mbs[0].step, mbs, k))
  placed = [modes.place(p, micro, device, row_images=True) for p in parts]
  jax.block_until_ready(placed)
  t_have = time.perf_counter()
  rows = []
  for j, mb in enumerate(mbs):
    t_want = time.perf_counter()
    batch = modes.global_batch([placed[j]], shardings)
    t_got = time.perf_counter()
    state, metrics = fn(state, batch)
    m = host_metrics(metrics)
    t_done = time.perf_counter()
    rows.append(
      {
        "transfer_s": (t_have - t_release) + (t_got - t_want),
        "exposed_s": (t_have - t_release if j == 0 else 0.0) + (t_got - t_want),
        "compute_s": t_done - t_got,
        "release_to_compute_s": t_got - t_release,
        "groups": [g.group_id for g in mb.groups],
        "unique_images": float(len(placed[j]["images"])),
        **{key: m[key] for key in modes._STEP_COUNTS},
      }
    )
  return state, rows, sizes


def _phase(spec, k, w, trainers, steps_mbs, counted, driver, row_spec, mesh, first, n, warmup):
  """``warmup + n`` steps of each mode, interleaved, from step ``first``; the measured rows."""
  import jax

  from knitjax.train import mm_step

  device = jax.local_devices()[0]
  shardings = mm_step.batch_shardings(mesh)
  t_count = spec["trainer_hosts"]
  ond = [steps_mbs[2 * (first + s) + 1] for s in range(warmup + n)]
  consumers = modes.OnDemandConsumers(
    [mb for mbs in ond for mb in mbs],
    counted,
    row_spec,
    w.micro_batches,
    [device],
    first=k,
    num_consumers=t_count,
  )
  rows = {m: [] for m in MODES}
  groups = {m: [] for m in MODES}
  sizes = []
  for s in range(warmup + n):
    for mode in MODES if s % 2 == 0 else MODES[::-1]:
      state, fn = trainers[mode]
      if mode == "on_demand":
        mbs = ond[s]
        state, r = modes.on_demand_step(
          state, fn, mbs, consumers, shardings, next_step=None, pipelined=False
        )
      else:
        mbs = steps_mbs[2 * (first + s)]
        state, r, sz = _centralized_step(
          state, fn, mbs, driver, k, w.micro_batches, device, shardings
        )
      trainers[mode] = (state, fn)
      if s >= warmup:
        rows[mode] += r
        groups[mode].append([[g.group_id for g in mb.groups] for mb in mbs])
        if mode == "centralized":
          sizes.append(sz)
  consumers.join()
  return rows, groups, sizes


def process_main(argv=None) -> None:
  """One trainer host's process (started by `run` inside its host)."""
  p = argparse.ArgumentParser()
  p.add_argument("--spec", required=True)
  p.add_argument("--process_id", type=int, required=True)
  a = p.parse_args(argv)
  with open(a.spec) as f:
    spec = json.load(f)
  k, t_count, workdir = a.process_id, spec["trainer_hosts"], os.path.dirname(a.spec)
  import faulthandler
  import signal

  faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung run's stacks, on demand
  _own_hostname(spec["addresses"][k])
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(spec["coordinator"], num_processes=t_count, process_id=k)
  import ml_collections
  import ray
  from jax.experimental import multihost_utils

  from knitjax import sharding
  from knitjax.distributed.ray_storage import NAMESPACE, RayStorageUnit
  from knitjax.transfer.access import RowSpec
  from knitjax.transfer.storage import StorageLimits
  from lab.bench.multimodal import _node_ids, _placed, _trainer
  from lab.bench.multimodal_workload import model_configs, write_groups

  config = ml_collections.ConfigDict(spec["multimodal"])
  # Its host's address: left to itself, Ray finds no route out of the namespace and takes the
  # head's node for this process's, so results for it would go to the head's host.
  ray.init(
    address=spec["ray_address"], _node_ip_address=spec["addresses"][k], include_dashboard=False
  )
  w = hosts_workload(config, t_count)
  model, vision = model_configs(config, w)
  plen = 1 + vision.num_image_tokens + w.text_tokens
  row_spec = RowSpec(estimator="grpo", prompt_len=plen, max_new_tokens=w.response_tokens, pad_id=0)
  limits = StorageLimits(
    vocab_size=model.vocab_size, max_seq_len=plen + w.response_tokens, max_bytes=1 << 34
  )
  phases = spec["phases"]
  total = sum(ph["warmup"] + ph["steps"] for ph in phases)
  names = [f"{spec['tag']}-unit{u}" for u in range(config.storage_units)]
  units, owned = [], None
  if k == 0:
    nodes = _node_ids(spec["unit_node"])
    units = [
      RayStorageUnit(limits, unit_id=u, node_id=nodes[0], name=names[u])
      for u in range(config.storage_units)
    ]
    raw = {u.unit_id: u for u in units}
    steps_mbs = write_groups(raw, w, vision, 2 * total, model.vocab_size, config.seed)
    owned = (
      ray.remote(SharedDriver)
      .options(  # held: an actor dies with its owner's handles
        num_cpus=0,
        max_concurrency=t_count + 1,
        name=f"{spec['tag']}-driver",
        namespace=NAMESPACE,
        **_placed(spec["driver_node"]),
      )
      .remote(raw, row_spec, t_count, w.row_format)
    )
  else:
    discard = {u: _Discard() for u in range(config.storage_units)}
    steps_mbs = write_groups(discard, w, vision, 2 * total, model.vocab_size, config.seed)
  _say(k, "groups stored")
  multihost_utils.sync_global_devices("stored")
  _say(k, "synced")
  raw = {u: RayStorageUnit.connect(names[u], limits, u) for u in range(config.storage_units)}
  driver = ray.get_actor(f"{spec['tag']}-driver", namespace=NAMESPACE)
  mesh = sharding.make_mesh((t_count, 1, 1), devices=jax.devices())
  trainers = {
    "centralized": _trainer(config, model, vision, mesh, dedup=False),
    "on_demand": _trainer(config, model, vision, mesh, dedup=True),
  }
  _say(k, "trainers built")
  first = 0
  try:
    with jax.set_mesh(mesh):
      for ph in phases:
        _wait_file(os.path.join(workdir, f"go_{ph['name']}"), spec["timeout_s"])
        multihost_utils.sync_global_devices(f"go {ph['name']}")
        _say(k, f"phase {ph['name']}")
        counted = {u: modes.Counted(unit) for u, unit in raw.items()}
        rows, groups, sizes = _phase(
          spec, k, w, trainers, steps_mbs, counted, driver, row_spec, mesh, first,
          ph["steps"], ph["warmup"],
        )  # fmt: skip
        first += ph["warmup"] + ph["steps"]
        moved = sum(sum(c.bytes.values()) + sum(c.image_bytes.values()) for c in counted.values())
        # bytes per step, the warm-up's steps included (prefetch crosses step boundaries)
        record = {"rows": rows, "groups": groups, "sizes": sizes}
        record["bytes"] = moved / (ph["warmup"] + ph["steps"])
        path = os.path.join(workdir, f"rows_{ph['name']}_p{k}.json")
        with open(path + ".tmp", "w") as f:
          json.dump(record, f)
        os.replace(path + ".tmp", path)
      multihost_utils.sync_global_devices("done")
  finally:
    for u in units:
      u.close()
    del owned


# ----- the launcher (in the cluster bench's process) -----


def run(cluster, multimodal_config, real, env: dict, ray_address: str, t: int, workdir: str,
        *, rounds: int, timeout_s: float, log) -> dict:  # fmt: skip
  """T trainer processes in hosts ``trainer_hosts(t)`` of ``cluster`` (built with `host_cores`,
  Ray nodes on every host): calibration unshaped, then ``rounds`` rounds with every link at the
  real rate / the per-host dilation. Returns the figures of every phase."""
  os.makedirs(workdir, exist_ok=True)
  for name in os.listdir(workdir):
    if name.startswith(("go_", "rows_")):
      os.remove(os.path.join(workdir, name))
  c = multimodal_config
  hosts = trainer_hosts(t)
  phases = [{"name": "calibrate", "warmup": c.warmup, "steps": 1}]
  phases += [{"name": f"round{r}", "warmup": 0, "steps": c.steps} for r in range(rounds)]
  spec = {
    "trainer_hosts": t,
    "addresses": [cluster.hosts[h].address for h in hosts],
    "coordinator": f"{cluster.hosts[TRAINER0].address}:{PORT + t}",
    "ray_address": ray_address,
    "unit_node": cluster.hosts[STORAGE].address,
    "driver_node": cluster.hosts[CONTROLLER].address,
    "tag": f"mmh{os.getpid()}t{t}",
    "phases": phases,
    "timeout_s": timeout_s,
    "multimodal": c.to_dict(),
  }
  spec_path = os.path.join(workdir, "spec.json")
  with open(spec_path, "w") as f:
    json.dump(spec, f)
  w = hosts_workload(c, t)
  t0 = time.time()
  cluster.shape(None)
  procs, logs = [], []
  for k, h in enumerate(hosts):
    argv = [sys.executable, "-m", "lab.bench.multimodal_hosts", "--spec", spec_path]
    logs.append(open(os.path.join(workdir, f"log_p{k}.txt"), "w"))  # noqa: SIM115
    argv += ["--process_id", str(k)]
    procs.append(
      cluster.spawn(h, argv, cwd=REPO, env=env, stdout=logs[-1], stderr=subprocess.STDOUT)
    )
  out = {"trainer_hosts": t, "core_share": core_share(t, cluster.hosts[TRAINER0].cores)}
  out["workload"] = {"groups_per_step": w.groups_per_step, "rows_per_host": rows_per_host(w, t)}
  try:
    for ph in phases:
      if ph["name"] == "round0":
        d = per_host_dilation(
          real, out["calibrate"]["centralized"]["step_compute_s"], rows_per_host(w, t)
        )
        cluster.shape(d["link_mbit"])
        out["dilation"], out["link_mbit"] = d, d["link_mbit"]
        log(
          f"hosts T={t}: dilation per host {d['factor']:.1f} "
          f"({d['emulated_naive_s_per_row'] * 1e3:.1f} ms/row/host): links at "
          f"{d['link_mbit']:.0f} Mbit/s"
        )
      open(os.path.join(workdir, f"go_{ph['name']}"), "w").close()
      per = [_await(procs, logs, os.path.join(workdir, f"rows_{ph['name']}_p{k}.json"), timeout_s)
             for k in range(t)]  # fmt: skip
      out[ph["name"]] = figures(w, ph["steps"], per, per[0]["groups"])
      f = out[ph["name"]]
      log(f"hosts T={t} {ph['name']}: speedup {f['speedup']:.2f}x, latency ratio "
          f"{f['latency_ratio']:.1f}x ({time.time() - t0:.0f} s)")  # fmt: skip
    for p in procs:
      p.wait(timeout=120)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for f in logs:
      f.close()
  names = [ph["name"] for ph in phases[1:]]
  out["speedup"] = [out[n]["speedup"] for n in names]
  out["latency_ratio"] = [out[n]["latency_ratio"] for n in names]
  out["wall_s"] = time.time() - t0
  with open(os.path.join(workdir, "hosts.json"), "w") as f:  # kept if a later T fails
    json.dump(out, f, indent=1)
  return out


def _await(procs, logs, path: str, timeout: float) -> dict:
  deadline = time.time() + timeout
  while not os.path.exists(path):
    for k, p in enumerate(procs):
      if p.poll() is not None:
        logs[k].flush()
        with open(logs[k].name) as f:
          tail = f.read()[-2000:]
        raise RuntimeError(f"trainer process {k} exited {p.returncode}: {tail}")
    if time.time() > deadline:
      raise RuntimeError(f"no {path} after {timeout:.0f} s; see the log_p*.txt beside it.")
    time.sleep(0.2)
  with open(path) as f:
    return json.load(f)


if __name__ == "__main__":
  process_main()
