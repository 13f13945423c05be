"""Weight publish time per version: float32 blocking against bfloat16 async, FSDP and tensor meshes.

The decoder's params (random, built sharded on the train mesh by `sharding.init_sharded`) are
published onto a data-parallel rollout mesh, as a disaggregated run does after each mini-batch.
Variants per train mesh:

- ``f32_plain``: the previous publish, a blocking ``jax.device_put(params, rollout_shardings)``
  in float32. JAX copies a leaf device to device only where every rollout shard exists whole on
  a train device; the others (``host_leaves``) went through ``np.asarray`` of the whole array.
- ``f32_blocking`` / ``bf16_blocking``: `WeightSync` (staging layout, no host detour), waiting.
- ``bf16_async``: `WeightSync` in bfloat16, the copy completing in the background.

Per version: ``publish_s``, dispatch until the rollout can adopt it, and ``held_s``, how long
the trainer's thread was held (the whole copy when blocking; the dispatch when async). Medians
over ``repeats`` versions after one warm-up (compilation). ``bytes`` is one version's params in the
wire dtype (what each device of the data-parallel rollout mesh receives); ``host_leaves``
counts the leaves whose copy goes through the host, by JAX's rule (`weight_sync.via_host`).

Usage: python -m lab.bench --config configs/bench/weight_sync.py --workdir DIR
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
from flax import nnx

from knitjax import sharding
from knitjax.models.transformer import Transformer, TransformerConfig
from knitjax.runtime.weight_sync import WeightSync, via_host
from lab.bench.report import format_table, write_json

VARIANTS = ("f32_plain", "f32_blocking", "bf16_blocking", "bf16_async")


def host_leaves(params, rollout_shardings) -> int:
  """Leaves a plain ``jax.device_put`` sends through the host (`weight_sync.via_host`)."""
  pairs = zip(jax.tree.leaves(params), jax.tree.leaves(rollout_shardings), strict=True)
  return sum(via_host(x.sharding, d, x.shape) for x, d in pairs)


def _publisher(variant: str, rollout_shardings):
  """``publish(params, version) -> (held_s, publish_s)`` for one variant, the number of leaves
  it copies through the host, and a closer returning its route."""
  if variant == "f32_plain":

    def plain(params, version):
      t0 = time.perf_counter()
      jax.block_until_ready(jax.device_put(params, rollout_shardings))
      dt = time.perf_counter() - t0
      return dt, dt

    return plain, lambda params: host_leaves(params, rollout_shardings), lambda: "plain"
  dtype, mode = variant.split("_")
  sync = WeightSync(
    rollout_shardings,
    sync_dtype={"f32": "float32", "bf16": "bfloat16"}[dtype],
    publish="async" if mode == "async" else "blocking",
  )

  def publish(params, version):
    held = sync.publish(params, version)
    sync.wait()
    return held, sync.last_publish_s

  def close():
    sync.close()
    return sync.route

  return publish, sync.host_leaves, close


def measure(params, rollout_shardings, variant: str, repeats: int) -> dict:
  """Median publish and held seconds of ``variant`` over ``repeats`` versions (one warm-up)."""
  publish, count_host_leaves, close = _publisher(variant, rollout_shardings)
  times = [publish(params, v) for v in range(repeats + 1)][1:]
  route = close()
  leaves = jax.tree.leaves(params)
  itemsize = 4 if variant.startswith("f32") else 2
  return {
    "held_s": float(np.median([t[0] for t in times])),
    "publish_s": float(np.median([t[1] for t in times])),
    "bytes": sum(x.size * min(itemsize, x.dtype.itemsize) for x in leaves),
    "params": sum(x.size for x in leaves),
    "leaves": len(leaves),
    "host_leaves": count_host_leaves(params),
    "route": route,
  }


def run(config, workdir: str) -> dict:
  model = TransformerConfig(**config.model)
  devices = jax.devices()
  if len(devices) <= config.train_devices:
    raise ValueError(
      f"config.train_devices={config.train_devices} leaves no rollout device of {len(devices)}."
    )
  rollout_devices = devices[: len(devices) - config.train_devices]
  train_devices = devices[len(devices) - config.train_devices :]
  rollout_mesh = sharding.make_mesh((-1, 1, 1), devices=rollout_devices)
  rows = []
  for mesh_name, shape in config.train_meshes.items():
    train_mesh = sharding.make_mesh(tuple(shape), devices=train_devices)
    _, params = sharding.init_sharded(lambda: Transformer(model, rngs=nnx.Rngs(0)), train_mesh)
    rollout_shardings = sharding.state_shardings(params, rollout_mesh)
    for variant in config.variants:
      got = measure(params, rollout_shardings, variant, config.repeats)
      rows.append({"mesh": mesh_name, "variant": variant, **got})
    del params
  base = {r["mesh"]: r for r in rows if r["variant"] == rows[0]["variant"]}
  for r in rows:
    r["held_vs_first"] = r["held_s"] / base[r["mesh"]]["held_s"]
  print(f"publish of {rows[0]['params'] / 1e6:.1f}M params ({rows[0]['leaves']} leaves), median:")
  print(
    format_table(
      rows,
      ["mesh", "variant", "route", "publish_s", "held_s", "held_vs_first", "host_leaves", "bytes"],
    )
  )
  result = {
    "rows": rows,
    "model": config.model.to_dict(),
    "train_meshes": {k: list(v) for k, v in config.train_meshes.items()},
    "rollout_devices": len(rollout_devices),
    "train_devices": len(train_devices),
    "repeats": config.repeats,
    "backend": jax.default_backend(),
  }
  write_json(workdir, "weight_sync", result)
  _plot(workdir, rows)
  return result


def _plot(workdir: str, rows: list[dict]) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  meshes = list(dict.fromkeys(r["mesh"] for r in rows))
  variants = list(dict.fromkeys(r["variant"] for r in rows))
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
  width = 0.8 / len(variants)
  for ax, key, title in zip(
    axes, ("publish_s", "held_s"), ("until adoptable", "trainer held"), strict=True
  ):
    for i, v in enumerate(variants):
      values = [next(r[key] for r in rows if r["mesh"] == m and r["variant"] == v) for m in meshes]
      ax.bar(np.arange(len(meshes)) + i * width, values, width, label=v)
    ax.set_xticks(np.arange(len(meshes)) + width * (len(variants) - 1) / 2, meshes)
    ax.set_title(f"seconds per version, {title}")
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "weight_sync.png"), dpi=120)
  plt.close(fig)
