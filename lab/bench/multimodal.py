"""Multimodal transfer + training: the centralized baseline against on-demand access with dedup.

One run, both modes side by side on the same stored groups, model and initial params:

- ``centralized`` + naive encoding (what single-controller systems do): a driver (a Ray actor,
  its own process) waits for the step, gathers every payload of it from the storage-unit
  actors, materialises one sample per row (each row's own image as the processor's float32
  pixel array, ``row_format``), splits each mini-batch into the consumers' contiguous shares and
  keeps them for the consumers, which take them (bytes cross driver -> trainer process). Training
  of the step starts when that is done; nothing is prefetched. The trainer encodes every row.
- ``on_demand`` + encoder dedup (knitjax): each consumer fetches exactly its groups of a
  mini-batch from the storage-unit actors, each unique image once, as stored (uint8), and
  prepares the next mini-batch while the current one computes (prefetch 1). One encoder pass per
  unique image per mini-batch.

Consumers are threads of the trainer process (one per data-parallel shard of the train mesh,
as the hosts of a multi-host trainer each supply their rows); storage units are Ray actors;
the train step is one jitted step on the whole mesh, fed with every consumer's rows. A step's
mini-batches are all released when the trainer starts the step (rollout ahead of training, the
conservative choice for on-demand: in a pipelined run the next step's mini-batches are often
released before, and its first fetch hides too).

Reported per mode: bytes moved (total, image bytes, through the busiest endpoint), transfer
latency per mini-batch (p50/p99: until a consumer had its rows, from when it could start) and
its exposed part (the trainer's wait for data), release-to-first-compute, the encoder's images
and backward passes (the step's own counts), seconds per train step split into transfer
(exposed) and compute; ``latency_ratio`` = centralized / on-demand exposed transfer per
mini-batch; ``speedup`` = centralized step / on-demand step. Counts are checked: every stored
group is consumed once per mode (group ids and row counts), no payload lost or duplicated.

A per-link bandwidth model (``bandwidths_gbps``) puts next to the measured local figures the
transfer seconds the same bytes would take through network endpoints of that bandwidth
(busiest endpoint's bytes / bandwidth; the centralized driver receives, then sends), labelled
``modelled``. Locally, "transfer" crosses process boundaries through Ray's shared-memory object
store, not a network.

Here: the measurement (both modes' train steps, interleaved), the figures above, the plot and the
table. The workload points and the stored groups come from `lab.bench.multimodal_workload`;
each mode's driver, consumers and step from `lab.bench.multimodal_modes`.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time

import jax
import numpy as np
import optax
from flax import nnx

from knitjax import sharding
from knitjax.models.vlm import VLM
from knitjax.train import losses, mm_step
from knitjax.train.step import StepHParams, init_train_state
from knitjax.transfer.access import RowSpec
from knitjax.transfer.storage import StorageLimits
from lab.bench import multimodal_modes as modes
from lab.bench.multimodal_workload import (
  IMAGE_TOKEN,
  Workload,
  model_configs,
  row_flops,
  workloads,
  write_groups,
)
from lab.bench.report import format_table, write_json

MODES = ("centralized", "on_demand")


def _trainer(config, model, vision, mesh, dedup: bool):
  graphdef, params = sharding.init_sharded(
    lambda: VLM(model, vision, image_token_id=IMAGE_TOKEN, rngs=nnx.Rngs(config.seed)), mesh
  )
  opt = optax.adamw(1e-4)
  state, shardings = init_train_state(params, opt, mesh)
  step = mm_step.compile_mm_train_step(
    graphdef=graphdef,
    optimizer=opt,
    hparams=StepHParams(loss=losses.LossConfig(), max_new_tokens=config.workload.response_tokens),
    state_shardings=shardings,
    mesh=mesh,
    encoder_dedup=dedup,
  )
  return state, step


def _endpoint_bytes(mode: str, counted, sizes_per_step) -> dict[str, float]:
  """Bytes through each endpoint (units, consumers, driver) over every step, warm-up included."""
  ep: collections.Counter = collections.Counter()
  if mode == "on_demand":  # unit -> consumer
    for u in counted:
      for who, n in [*u.bytes.items(), *u.image_bytes.items()]:
        ep[f"unit{u.unit_id}"] += n
        ep[who] += n
    return dict(ep)
  for sizes in sizes_per_step:  # unit -> driver -> consumer
    for u, n in sizes["received"].items():
      ep[f"unit{u}"] += n
      ep["driver"] += n
    for c, n in sizes["sent"].items():
      ep[f"consumer-{c}"] += n
      ep["driver"] += n
  return dict(ep)


def _summary(rows, steps: int) -> dict:
  t = np.array([r["transfer_s"] for r in rows])
  e = np.array([r["exposed_s"] for r in rows])
  c = np.array([r["compute_s"] for r in rows])
  first = np.array([r["release_to_compute_s"] for r in rows[:: max(1, len(rows) // steps)]])
  return {
    "transfer_p50_s": float(np.percentile(t, 50)),
    "transfer_p99_s": float(np.percentile(t, 99)),
    "exposed_p50_s": float(np.percentile(e, 50)),
    "exposed_p99_s": float(np.percentile(e, 99)),
    "exposed_mean_s": float(e.mean()),
    "release_to_first_compute_p50_s": float(np.percentile(first, 50)),
    "step_transfer_s": float(e.sum() / steps),
    "step_compute_s": float(c.sum() / steps),
    "step_s": float((e.sum() + c.sum()) / steps),
    "encoder_images_per_minibatch": float(np.mean([r["encoder_images_encoded"] for r in rows])),
    "encoder_backward_passes_per_minibatch": float(
      np.mean([r["encoder_backward_passes"] for r in rows])
    ),
    "unique_images_per_minibatch": float(np.mean([r["unique_images"] for r in rows])),
  }


def _check_counts(mode: str, rows, steps_mbs, w: Workload) -> dict:
  """No group lost or consumed twice; every row trained once (rows counted by the step)."""
  want = sorted(g.group_id for mbs in steps_mbs for mb in mbs for g in mb.groups)
  got = sorted(gid for r in rows for gid in r["groups"])
  seqs = sum(r["num_seqs"] for r in rows)
  ok = got == want and seqs == len(want) * w.group_size
  if not ok:
    raise RuntimeError(
      f"{mode}: consumed {len(got)} groups / {seqs} rows; want {len(want)} / "
      f"{len(want) * w.group_size} (lost or duplicated payloads)."
    )
  return {"groups": len(got), "rows": int(seqs), "lost": 0, "duplicated": 0}


def _run_steps(config, w, trainers, steps_mbs, storage, driver, row_spec, mesh):
  """``warmup + steps`` train steps of each mode, interleaved; returns the measured ones."""
  devices = list(mesh.devices.flat)
  shardings = mm_step.batch_shardings(mesh)
  total = config.warmup + config.steps
  pipelined = w.release == "pipelined"
  ond_steps = [steps_mbs[2 * s + 1] for s in range(total)]  # each mode its own groups
  consumers = modes.OnDemandConsumers(
    [mb for mbs in ond_steps for mb in mbs], storage, row_spec, w.micro_batches, devices
  )
  if pipelined:
    consumers.release(ond_steps[0])
  rows = {m: [] for m in MODES}
  sizes: list = []
  measured_mbs = {m: [] for m in MODES}
  for s in range(total):
    order = MODES if s % 2 == 0 else MODES[::-1]  # interleaved: a busy machine slows both
    for mode in order:
      state, fn = trainers[mode]
      if mode == "on_demand":
        mbs = ond_steps[s]
        nxt = ond_steps[s + 1] if s + 1 < total else None
        state, r = modes.on_demand_step(
          state, fn, mbs, consumers, shardings, next_step=nxt, pipelined=pipelined
        )
      else:
        mbs = steps_mbs[2 * s]
        state, r, sz = modes.centralized_step(
          state, fn, mbs, driver, w.micro_batches, devices, shardings
        )
        sizes.append(sz)  # bytes of every step (the same each step; prefetch crosses steps)
      trainers[mode] = (state, fn)
      if s >= config.warmup:
        rows[mode] += r
        measured_mbs[mode].append(mbs)
  consumers.join()
  return rows, sizes, measured_mbs


def measure(config, w: Workload, mesh) -> dict:
  """Both modes on one workload; returns its JSON entry."""
  import ray

  from knitjax.distributed.ray_storage import RayStorageUnit

  model, vision = model_configs(config, w)
  flops = row_flops(model, vision, w)
  plen = 1 + vision.num_image_tokens + w.text_tokens
  row_spec = RowSpec(estimator="grpo", prompt_len=plen, max_new_tokens=w.response_tokens, pad_id=0)
  total_steps = config.warmup + config.steps
  limits = StorageLimits(
    vocab_size=model.vocab_size, max_seq_len=plen + w.response_tokens, max_bytes=1 << 34
  )
  unit_nodes = _node_ids(config.get("unit_nodes", ""))
  units = [
    RayStorageUnit(
      limits, unit_id=u, node_id=unit_nodes[u % len(unit_nodes)] if unit_nodes else None
    )
    for u in range(config.storage_units)
  ]
  try:
    raw = {u.unit_id: u for u in units}
    steps_mbs = write_groups(raw, w, vision, 2 * total_steps, model.vocab_size, config.seed)
    counted = {u: modes.Counted(unit) for u, unit in raw.items()}
    driver = ray.remote(modes.Driver).options(num_cpus=0, **_placed(config.get("driver_node", "")))
    driver = driver.remote(raw, row_spec, config.consumers, w.row_format)
    trainers = {
      "centralized": _trainer(config, model, vision, mesh, dedup=False),
      "on_demand": _trainer(config, model, vision, mesh, dedup=True),
    }
    with jax.set_mesh(mesh):
      rows, sizes, measured_mbs = _run_steps(
        config, w, trainers, steps_mbs, counted, driver, row_spec, mesh
      )
    out = {"workload": dataclasses.asdict(w), "row_flops": flops}
    for mode in MODES:
      # Bytes over all steps, warm-up included (on demand prefetches across step boundaries).
      ep = _endpoint_bytes(mode, counted.values(), sizes)
      counts = _check_counts(mode, rows[mode], measured_mbs[mode], w)
      if mode == "on_demand":
        image_bytes = sum(sum(c.image_bytes.values()) for c in counted.values())
        total = sum(sum(c.bytes.values()) for c in counted.values()) + image_bytes
      else:
        image_bytes = sum(sum(z["sent_images"].values()) for z in sizes)
        total = sum(sum(z["received"].values()) + sum(z["sent"].values()) for z in sizes)
      out[mode] = {
        **_summary(rows[mode], config.steps),
        "bytes_per_step": total / total_steps,
        "image_bytes_per_step": image_bytes / total_steps,
        "busiest_endpoint": max(ep, key=ep.get),
        "busiest_endpoint_bytes_per_step": max(ep.values()) / total_steps,
        "endpoint_bytes_per_step": {k: v / total_steps for k, v in sorted(ep.items())},
        "counts": counts,
      }
    c, o = out["centralized"], out["on_demand"]
    # What one group weighs: as stored (payload + its image, what on demand fetches) and as the
    # driver hands it to the consumers (G rows, each with its own image copy).
    out["payload_bytes_per_group"] = {
      "stored": o["bytes_per_step"] / w.groups_per_step,
      "centralized_rows": sum(
        c["endpoint_bytes_per_step"][k]
        for k in c["endpoint_bytes_per_step"]
        if k.startswith("consumer")
      )
      / w.groups_per_step,
    }
    out["latency_ratio"] = c["exposed_mean_s"] / max(o["exposed_mean_s"], 1e-9)
    out["speedup"] = c["step_s"] / o["step_s"]
    out["image_bytes_cut"] = c["image_bytes_per_step"] / max(o["image_bytes_per_step"], 1)
    out["modelled"] = _modelled(out, config, w)
    return out
  finally:
    for u in units:
      u.close()


def _node_ids(addresses: str) -> list[str]:
  """Ray node ids of the nodes at ``addresses`` (comma-separated IPs; "": none given)."""
  import ray

  wanted = [a.strip() for a in addresses.split(",") if a.strip()]
  nodes = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
  missing = [a for a in wanted if a not in nodes]
  if missing:
    raise ValueError(f"no live Ray node at {missing}; the cluster's nodes are {sorted(nodes)}.")
  return [nodes[a] for a in wanted]


def _placed(address: str) -> dict:
  from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

  ids = _node_ids(address)
  return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ids[0], soft=False)} if ids else {}


def _modelled(out: dict, config, w: Workload) -> dict:
  """Transfer seconds the measured bytes would take through network endpoints (modelled).

  Centralized: the driver receives the step, then sends it (its endpoint's bytes in series).
  On demand: a mini-batch's fetch (the busiest consumer's share) hides behind the previous
  mini-batch's measured compute where it fits (the excess is exposed); with ``release =
  "step_start"`` the step's first fetch has nothing to hide behind. ``latency_ratio`` is None
  where on demand exposes nothing.
  """
  c, o = out["centralized"], out["on_demand"]
  consumers = [k for k in o["endpoint_bytes_per_step"] if k.startswith("consumer")]
  busiest = max(o["endpoint_bytes_per_step"][k] for k in consumers) if consumers else 0.0
  per_mb = busiest / w.minibatches
  compute_mb = o["step_compute_s"] / w.minibatches
  res = {}
  for gbps in config.bandwidths_gbps:
    bw = gbps * 1e9 / 8
    cen = c["endpoint_bytes_per_step"].get("driver", 0.0) / bw
    fetch = per_mb / bw
    hidden = w.minibatches if w.release == "pipelined" else w.minibatches - 1
    ond = (w.minibatches - hidden) * fetch + hidden * max(0.0, fetch - compute_mb)
    res[f"{gbps:g}gbps"] = {
      "centralized_transfer_s": cen,
      "on_demand_exposed_s": ond,
      "latency_ratio": cen / ond if ond > 0 else None,
      "speedup_with_measured_compute": (cen + c["step_compute_s"]) / (ond + o["step_compute_s"]),
    }
  return res


def _plot(results: list[dict], path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  names = [r["workload"]["name"] for r in results]
  x = np.arange(len(names))
  for i, mode in enumerate(MODES):
    tr = [r[mode]["step_transfer_s"] for r in results]
    co = [r[mode]["step_compute_s"] for r in results]
    xs = x + (i - 0.5) * 0.38
    axes[0].bar(xs, co, 0.38, label=f"{mode} compute", color=("C0", "C2")[i])
    axes[0].bar(xs, tr, 0.38, bottom=co, label=f"{mode} transfer (exposed)", color=("C1", "C3")[i])
    axes[1].bar(xs, [r[mode]["bytes_per_step"] / 2**20 for r in results], 0.38, label=mode)
  axes[0].set_ylabel("seconds per train step")
  axes[0].set_title("transfer + training (measured)")
  axes[1].set_ylabel("MiB moved per train step")
  axes[1].set_yscale("log")
  axes[1].set_title("bytes moved")
  axes[2].bar(x - 0.2, [r["speedup"] for r in results], 0.4, label="speedup")
  axes[2].bar(x + 0.2, [r["latency_ratio"] for r in results], 0.4, label="latency ratio")
  axes[2].set_yscale("log")
  axes[2].axhline(5.8, color="k", lw=0.8, ls="--")
  axes[2].axhline(100, color="k", lw=0.8, ls=":")
  axes[2].set_title("centralized / on demand (paper: 5.8x dashed, 100x dotted)")
  for ax in axes:
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def run(config, workdir: str) -> dict:
  from knitjax.distributed.local_ray import ensure_ray

  ensure_ray(config.get("ray_address", ""), needed_by="the multimodal benchmark")
  devices = jax.devices()[: config.consumers]
  if len(devices) < config.consumers:
    raise ValueError(f"{config.consumers} consumers need {config.consumers} devices.")
  mesh = sharding.make_mesh((config.consumers, 1, 1), devices=devices)
  results = []
  for w in workloads(config):
    t = time.time()
    r = measure(config, w, mesh)
    r["wall_s"] = time.time() - t
    results.append(r)
    print(
      f"{w.name}: speedup {r['speedup']:.2f}x, latency ratio {r['latency_ratio']:.0f}x "
      f"({r['wall_s']:.0f} s)",
      flush=True,
    )
  out = {
    "bench": "multimodal",
    "consumers": config.consumers,
    "storage_units": config.storage_units,
    "steps": config.steps,
    "warmup": config.warmup,
    "vision": dict(config.vision),
    "model": dict(config.model),
    "results": results,
    "main": results[0],
  }
  write_json(workdir, "multimodal", out)
  _plot(results, os.path.join(workdir, "multimodal.png"))
  table = [
    {
      "workload": r["workload"]["name"],
      "G": r["workload"]["group_size"],
      "image": r["workload"]["image_size"],
      "resp": r["workload"]["response_tokens"],
      "enc share": f"{r['row_flops']['encoder_share']:.0%}",
      "MiB cen": r["centralized"]["bytes_per_step"] / 2**20,
      "MiB od": r["on_demand"]["bytes_per_step"] / 2**20,
      "cen xfer s": r["centralized"]["step_transfer_s"],
      "cen comp s": r["centralized"]["step_compute_s"],
      "od xfer s": r["on_demand"]["step_transfer_s"],
      "od comp s": r["on_demand"]["step_compute_s"],
      "latency": r["latency_ratio"],
      "speedup": r["speedup"],
    }
    for r in results
  ]
  print(format_table(table, list(table[0])))
  return out
