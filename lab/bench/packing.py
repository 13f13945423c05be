"""Useful tokens per second of the train step, packed rows against padded rows, same rows.

A mini-batch of ``rows`` rows is drawn once: prompt lengths uniform in ``[prompt_min, P]``,
response lengths lognormal (median ``response_median``, log-sd ``response_sigma``) rounded and
clipped to ``[1, N]``, a long tail as GRPO's responses have. The same rows are laid out twice:
padded (``[rows, P + N]``, `knitjax.train.batch.make_batch`) and packed (``[S, pack_len]``,
`knitjax.train.packing`, ``pack_len`` 0 meaning ``P + N``), and the real jitted train step
(`knitjax.train.step.compile_train_step`, AdamW, the configured micro-batches) runs each
``repeats`` times after a compile-and-warm-up call. Useful tokens are the rows' real tokens
(prompt + response); useful tokens/s divides them by the median step time. Also reported: the
token fill (real tokens / token positions) and the packed step's loss next to the padded one's (the
same up to float32 summation order, as tests/train/test_packing.py checks).

Usage: python -m lab.bench --config configs/bench/packing.py --workdir DIR
"""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx

from knitjax import sharding
from knitjax.models.transformer import Transformer, TransformerConfig
from knitjax.train import losses, packing
from knitjax.train.batch import make_batch, pad_rows, split_micro_batches
from knitjax.train.optimizer import make_optimizer
from knitjax.train.step import (
  StepHParams,
  batch_shardings,
  compile_train_step,
  host_metrics,
  init_train_state,
)
from lab.bench.report import format_table, write_json


def _rows(config) -> dict[str, np.ndarray]:
  """The mini-batch's padded arrays (the module docstring's length mix)."""
  rng = np.random.default_rng(config.seed)
  p, n, r, vocab = config.prompt_len, config.max_new_tokens, config.rows, config.model.vocab_size
  prompt_lens = rng.integers(config.prompt_min, p + 1, r)
  resp = rng.lognormal(np.log(config.response_median), config.response_sigma, r)
  resp_lens = np.clip(np.round(resp), 1, n).astype(np.int64)
  prompts = [rng.integers(1, vocab, k).astype(np.int32) for k in prompt_lens]
  responses = [rng.integers(1, vocab, k).astype(np.int32) for k in resp_lens]
  logps = [rng.normal(-2.0, 0.5, k).astype(np.float32) for k in resp_lens]
  adv = rng.normal(size=r).astype(np.float32)
  return make_batch(
    pad_rows(prompts, responses, logps), adv, prompt_len=p, max_new_tokens=n, pad_id=0
  )


def _time_step(config, mesh, batch: dict, *, packed: bool) -> dict:
  model = TransformerConfig(**config.model)
  graphdef, params = sharding.init_sharded(lambda: Transformer(model, rngs=nnx.Rngs(0)), mesh)
  optimizer = make_optimizer(config.optimizer)
  state, shardings = init_train_state(params, optimizer, mesh)
  hparams = StepHParams(loss=losses.LossConfig(), max_new_tokens=config.max_new_tokens)
  step = compile_train_step(
    graphdef=graphdef, optimizer=optimizer, hparams=hparams, state_shardings=shardings,
    mesh=mesh, packed=packed,
  )  # fmt: skip
  k = config.micro_batches
  dev = jax.device_put(split_micro_batches(batch, k), batch_shardings(mesh, packed=packed))
  with jax.set_mesh(mesh):
    t0 = time.perf_counter()
    state, metrics = step(state, dev)  # compile + first run
    first = host_metrics(metrics)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(config.repeats):
      t0 = time.perf_counter()
      state, metrics = step(state, dev)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - t0)
  useful = int(np.asarray(batch["valid"]).sum())
  step_s = float(np.median(times))
  return {
    "layout": "packed" if packed else "padded",
    "sequences": int(batch["valid"].shape[0]),
    "seq_len": int(batch["valid"].shape[1]),
    "token_positions": int(batch["valid"].size),
    "useful_tokens": useful,
    "loss_tokens": int(np.asarray(batch["loss_mask"]).sum()),
    "fill": useful / batch["valid"].size,
    "step_s": step_s,
    "step_s_all": times,
    "compile_and_first_s": compile_s,
    "useful_tokens_per_s": useful / step_s,
    "first_loss": first["loss"],
  }


def run(config, workdir: str) -> dict:
  mesh = sharding.make_mesh(tuple(config.mesh_shape), devices=jax.devices()[: config.devices])
  padded = _rows(config)
  pack_len = config.pack_len or config.prompt_len + config.max_new_tokens
  spec = packing.PackSpec(
    pack_len=pack_len,
    multiple=config.micro_batches * int(np.prod([mesh.shape[a] for a in sharding.BATCH_AXES])),
    buckets=config.pack_buckets,
  )
  t0 = time.perf_counter()
  packed = spec(padded)
  pack_s = time.perf_counter() - t0
  results = [
    _time_step(config, mesh, padded, packed=False),
    _time_step(config, mesh, packed, packed=True),
  ]
  results[1]["pack_host_s"] = pack_s
  ratio = results[1]["useful_tokens_per_s"] / results[0]["useful_tokens_per_s"]
  columns = ["layout", "sequences", "seq_len", "fill", "step_s", "useful_tokens_per_s",
             "first_loss"]  # fmt: skip
  print(format_table(results, columns))
  print(f"packed / padded useful tokens/s: {ratio:.2f}x (host packing {pack_s * 1e3:.1f} ms)")
  result = {
    "layouts": results,
    "packed_over_padded": ratio,
    "rows": config.rows,
    "prompt_len": config.prompt_len,
    "max_new_tokens": config.max_new_tokens,
    "pack_len": pack_len,
    "pack_buckets": config.pack_buckets,
    "response_median": config.response_median,
    "response_sigma": config.response_sigma,
    "micro_batches": config.micro_batches,
    "model": config.model.to_dict(),
    "devices": config.devices,
    "backend": jax.default_backend(),
  }
  write_json(workdir, "packing", result)
  _plot(workdir, results, ratio)
  return result


def _plot(workdir: str, results: list[dict], ratio: float) -> None:
  import os

  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
  names = [r["layout"] for r in results]
  axes[0].bar(names, [r["useful_tokens_per_s"] for r in results], color=["tab:gray", "tab:blue"])
  axes[0].set_ylabel("useful tokens / s")
  axes[0].set_title(f"train step throughput ({ratio:.2f}x)")
  axes[1].bar(names, [r["fill"] for r in results], color=["tab:gray", "tab:blue"])
  axes[1].set_ylim(0, 1)
  axes[1].set_ylabel("real tokens / token positions")
  axes[1].set_title("fill")
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "packing.png"), dpi=120)
  plt.close(fig)
