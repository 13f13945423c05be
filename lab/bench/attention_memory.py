"""Memory of one attention layer, dense against blockwise ("xla"), from XLA's compiled analysis.

For each sequence length the layer (`knitjax.models.layers.Attention`: q/k/v projections with
bias, RoPE, `attention.attend`, output projection) is lowered on abstract inputs and compiled
twice per implementation: the forward alone, and forward + backward (gradients of a scalar of the
output with respect to the params and the input). ``compiled.memory_analysis()`` gives the bytes
XLA plans: ``temp_bytes`` (scratch: scores, activations kept for the backward, gradients in
flight) and ``peak_bytes`` (arguments + outputs - aliased + temporaries). Nothing runs and nothing
is allocated, so long lengths cost a compile only.

Usage: python -m lab.bench --config configs/bench/attention_memory.py --workdir DIR
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from knitjax.models import dtypes, layers
from lab.bench.compiled_memory import MIB, compiled_memory
from lab.bench.report import format_table, write_json

PASSES = ("forward", "forward_backward")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
  """The attention layer's shape (heads, widths) and the batch it runs on."""

  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  batch: int
  dtype: str = "float32"


def _layer(shape: Shape, impl: str) -> layers.Attention:
  return layers.Attention(
    d_model=shape.d_model, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
    head_dim=shape.head_dim, rope_theta=1e6, norm_eps=1e-6, qk_norm=False, qkv_bias=True,
    dtype=dtypes.DTYPES[shape.dtype], rngs=nnx.Rngs(0), attention=impl,
  )  # fmt: skip


def measure(shape: Shape, impl: str, t: int) -> dict[str, dict[str, int]]:
  """Compiled bytes of the forward and of forward + backward of one layer at length ``t``."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: _layer(shape, impl)))
  dtype = dtypes.DTYPES[shape.dtype]
  x = jax.ShapeDtypeStruct((shape.batch, t, shape.d_model), dtype)
  valid = jax.ShapeDtypeStruct((shape.batch, t), jnp.bool_)
  positions = jax.ShapeDtypeStruct((shape.batch, t), jnp.int32)

  def forward(params, x, positions, valid):
    layer = nnx.merge(graphdef, params)
    sin_cos = layers.rope_sin_cos(positions, shape.head_dim, layer.rope_theta)
    return layer(x, sin_cos, valid)[0]

  def loss(params, x, positions, valid):
    return jnp.sum(forward(params, x, positions, valid).astype(jnp.float32))

  backward = jax.grad(loss, argnums=(0, 1))
  return {
    "forward": compiled_memory(forward, params, x, positions, valid),
    "forward_backward": compiled_memory(backward, params, x, positions, valid),
  }


def run(config, workdir: str) -> dict:
  shape = Shape(**config.shape)
  rows = []
  for t in config.lengths:
    for impl in config.impls:
      got = measure(shape, impl, t)
      row = {"T": t, "impl": impl}
      for name in PASSES:
        row.update({f"{name}_{k}": v for k, v in got[name].items()})
      rows.append(row)
  columns = ["T", "impl"] + [f"{p}_{k}" for p in PASSES for k in ("temp_bytes", "peak_bytes")]
  print("MiB (XLA memory analysis; peak = arguments + outputs - aliased + temporaries):")
  print(format_table([{k: v / MIB if "bytes" in k else v for k, v in r.items()} for r in rows],
                     columns))  # fmt: skip
  result = {
    "rows": rows,
    "shape": dataclasses.asdict(shape),
    "lengths": list(config.lengths),
    "impls": list(config.impls),
    "backend": jax.default_backend(),
  }
  write_json(workdir, "attention_memory", result)
  _plot(workdir, rows, config.impls)
  return result


def _plot(workdir: str, rows: list[dict], impls) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
  for ax, name in zip(axes, PASSES, strict=True):
    for impl in impls:
      mine = [r for r in rows if r["impl"] == impl]
      ts = np.array([r["T"] for r in mine])
      ax.plot(ts, [r[f"{name}_temp_bytes"] / MIB for r in mine], "o-", label=f"{impl} temp")
      ax.plot(ts, [r[f"{name}_peak_bytes"] / MIB for r in mine], "x--", label=f"{impl} peak")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_title(name.replace("_", " + "))
  axes[0].set_ylabel("MiB")
  axes[1].legend(fontsize=8)
  fig.suptitle("One attention layer: compiled memory, dense vs blockwise")
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "attention_memory.png"), dpi=120)
  plt.close(fig)
