"""Train-step memory and compile time with and without remat and the layer scan.

For each combination of ``TransformerConfig.remat`` (config.remats) and ``scan_layers`` (False,
True) the real jitted train step is traced on abstract inputs, lowered and compiled (nothing
runs: `lab.bench.lora_memory.measure`), and XLA's memory analysis gives its peak and
temporary bytes; the seconds that took are the compile time. The unrolled layer loop compiles
one copy of the block per layer, the scan one; remat keeps only each block's input for the
backward pass and recomputes the rest.

Usage: python -m lab.bench --config configs/bench/layer_memory.py[:quick] --workdir DIR
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax

from knitjax import sharding
from knitjax.models.transformer import TransformerConfig
from lab.bench.lora_memory import measure
from lab.bench.report import format_table, write_json


def run(config, workdir: str) -> dict:
  model = TransformerConfig(**config.model)
  mesh = sharding.make_mesh(tuple(config.mesh_shape), devices=jax.devices()[: config.devices])
  rows = []
  for scan in (False, True):
    for remat in config.remats:
      variant = dataclasses.replace(model, remat=remat, scan_layers=scan)
      t0 = time.perf_counter()
      got = measure(
        variant, mesh, rows=config.rows, seq_len=config.seq_len,
        micro_batches=config.micro_batches, kl_coef=0.0,
      )  # fmt: skip
      rows.append({
        "scan_layers": scan, "remat": remat, "compile_s": time.perf_counter() - t0,
        "peak_bytes": got["peak_bytes"], "temp_bytes": got["temp_bytes"],
        "argument_bytes": got["argument_bytes"],
      })  # fmt: skip
  base = rows[0]
  for row in rows:
    row["temp_vs_plain"] = row["temp_bytes"] / base["temp_bytes"]
    row["compile_vs_plain"] = row["compile_s"] / base["compile_s"]
  mib = [{k: v / 2**20 if k.endswith("bytes") else v for k, v in r.items()} for r in rows]
  print(f"train step, {model.num_layers} layers, {config.rows} x {config.seq_len} tokens (MiB):")
  columns = ["scan_layers", "remat", "compile_s", "peak_bytes", "temp_bytes", "temp_vs_plain"]
  print(format_table(mib, columns))
  result = {
    "variants": rows,
    "model": config.model.to_dict(),
    "rows": config.rows,
    "seq_len": config.seq_len,
    "micro_batches": config.micro_batches,
    "backend": jax.default_backend(),
  }
  write_json(workdir, "layer_memory", result)
  _plot(workdir, rows)
  return result


def _plot(workdir: str, rows: list[dict]) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = [f"{'scan' if r['scan_layers'] else 'loop'}\n{r['remat']}" for r in rows]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3.5))
  ax1.bar(names, [r["temp_bytes"] / 2**20 for r in rows])
  ax1.set_ylabel("temporary MiB (XLA)")
  ax2.bar(names, [r["compile_s"] for r in rows])
  ax2.set_ylabel("compile s")
  fig.suptitle("Train step: layer loop vs scan, remat policies")
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "layer_memory.png"), dpi=120)
  plt.close(fig)
