"""Memory of the train step, full fine-tuning against LoRA, from XLA's compiled memory analysis.

For each variant the real jitted train step (`knitjax.train.step.compile_train_step`, with the
builder's shardings and donation) is lowered on abstract inputs and compiled, and
``compiled.memory_analysis()`` gives the bytes XLA plans per device: arguments (params, optimizer
state, batch, and the reference or the frozen base), outputs, the donated part of them (aliased),
and temporaries (activations, gradients, optimizer scratch). Nothing is allocated: the model is
only traced, so a 135M-parameter shape costs the compile alone.

Alongside: the bytes of what each variant trains and optimizes (params + AdamW moments) and what
weight sync publishes per version (every param for full fine-tuning, the adapters for LoRA).
Variants: ``full`` (kl_coef > 0: a copy of the params is the reference), ``lora`` (the base in
float32; it is also the reference, with the adapters off) and ``lora_bf16`` (the base stored in
bfloat16). ``peak_bytes`` = arguments + outputs - aliased + temporaries.

Usage: python -m lab.bench --config configs/bench/lora_memory.py --workdir DIR
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from knitjax import sharding
from knitjax.models import lora
from knitjax.models.transformer import Transformer, TransformerConfig
from knitjax.train import losses
from knitjax.train.optimizer import make_optimizer
from knitjax.train.step import (
  MICRO_BATCH_FIELDS,
  StepHParams,
  TrainState,
  batch_shardings,
  compile_train_step,
)
from lab.bench.compiled_memory import memory_stats
from lab.bench.report import format_table, write_json

_BATCH_DTYPES = {"valid": np.bool_, "loss_mask": np.float32, "behavior_logp": np.float32}


@dataclasses.dataclass(frozen=True)
class _Opt:
  """The optimizer settings `make_optimizer` reads (AdamW, clipping)."""

  lr: float = 1e-5
  warmup_steps: int = 0
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  grad_clip: float = 1.0


def _abstract(tree, shardings):
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def _batch(mesh, rows: int, seq_len: int, micro_batches: int) -> dict:
  shardings = batch_shardings(mesh)
  out = {}
  for name in MICRO_BATCH_FIELDS:
    shape = (micro_batches, rows // micro_batches)
    shape = shape if name == "advantages" else (*shape, seq_len)
    out[name] = jax.ShapeDtypeStruct(
      shape, _BATCH_DTYPES.get(name, np.int32 if name != "advantages" else np.float32),
      sharding=shardings[name],
    )  # fmt: skip
  return out


def measure(model: TransformerConfig, mesh, *, rows: int, seq_len: int, micro_batches: int,
            kl_coef: float) -> dict:  # fmt: skip
  """Compiled memory of one variant's train step (LoRA when ``model.lora_rank`` > 0)."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0))))
  frozen = None
  if model.lora_rank:
    params, frozen = lora.split(params)
    dtype = lora.BASE_DTYPES[model.lora_base_dtype]
    frozen = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), frozen)
  optimizer = make_optimizer(_Opt())
  param_shardings = sharding.state_shardings(params, mesh)
  opt_shardings = sharding.optimizer_shardings(optimizer, params, mesh)
  opt_state = jax.eval_shape(optimizer.init, params)
  state = TrainState(
    params=_abstract(params, param_shardings), opt_state=_abstract(opt_state, opt_shardings)
  )
  shardings = TrainState(params=param_shardings, opt_state=opt_shardings)
  hparams = StepHParams(loss=losses.LossConfig(kl_coef=kl_coef), max_new_tokens=seq_len // 2)
  kwargs = dict(graphdef=graphdef, optimizer=optimizer, hparams=hparams, state_shardings=shardings)
  batch = _batch(mesh, rows, seq_len, micro_batches)
  if frozen is not None:
    frozen_shardings = sharding.state_shardings(frozen, mesh)
    step = compile_train_step(mesh=mesh, frozen_shardings=frozen_shardings, **kwargs)
    extra = [_abstract(frozen, frozen_shardings)]
  else:
    step = compile_train_step(mesh=mesh, with_ref=kl_coef > 0, **kwargs)
    extra = [state.params] if kl_coef > 0 else []
  with jax.set_mesh(mesh):
    out = memory_stats(step.lower(state, batch, *extra).compile())
  return {
    **out,
    "trained_param_bytes": lora.tree_bytes(params),
    "frozen_bytes": lora.tree_bytes(frozen) if frozen is not None else 0,
    "optimizer_state_bytes": lora.tree_bytes(opt_state),
    "reference_copy_bytes": lora.tree_bytes(params) if frozen is None and kl_coef > 0 else 0,
    "published_bytes": lora.tree_bytes(params),
  }


def run(config, workdir: str) -> dict:
  model = TransformerConfig(**config.model)
  mesh = sharding.make_mesh(tuple(config.mesh_shape), devices=jax.devices()[: config.devices])
  variants = {
    "full": model,
    "lora": dataclasses.replace(model, lora_rank=config.lora_rank, lora_alpha=config.lora_alpha),
    "lora_bf16": dataclasses.replace(
      model, lora_rank=config.lora_rank, lora_alpha=config.lora_alpha, lora_base_dtype="bfloat16"
    ),
  }
  rows = []
  for name, m in variants.items():
    got = measure(
      m, mesh, rows=config.rows, seq_len=config.seq_len, micro_batches=config.micro_batches,
      kl_coef=config.kl_coef,
    )  # fmt: skip
    rows.append({"variant": name, **got})
  full = rows[0]
  for row in rows:
    row["peak_vs_full"] = row["peak_bytes"] / full["peak_bytes"]
  mib = [{k: v / 2**20 if "bytes" in k else v for k, v in r.items()} for r in rows]
  columns = ["variant", "peak_bytes", "argument_bytes", "temp_bytes", "optimizer_state_bytes",
             "published_bytes", "peak_vs_full"]  # fmt: skip
  print("MiB per device (peak = arguments + outputs - aliased + temporaries):")
  print(format_table(mib, columns))
  result = {
    "variants": rows,
    "model": config.model.to_dict(),
    "lora_rank": config.lora_rank,
    "rows": config.rows,
    "seq_len": config.seq_len,
    "micro_batches": config.micro_batches,
    "kl_coef": config.kl_coef,
    "devices": config.devices,
    "backend": jax.default_backend(),
  }
  write_json(workdir, "lora_memory", result)
  _plot(workdir, rows)
  return result


def _plot(workdir: str, rows: list[dict]) -> None:
  import os

  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  parts = ["argument_bytes", "temp_bytes"]
  fig, ax = plt.subplots(figsize=(6, 3.5))
  names = [r["variant"] for r in rows]
  bottom = np.zeros(len(rows))
  for part in parts:
    values = np.array([r[part] for r in rows]) / 2**20
    ax.bar(names, values, bottom=bottom, label=part.removesuffix("_bytes"))
    bottom += values
  ax.set_ylabel("MiB per device")
  ax.set_title("Train step memory (XLA memory analysis)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "lora_memory.png"), dpi=120)
  plt.close(fig)
