"""Train-step and sampler throughput at a real model shape, and the train step's MFU.

The train step is knitjax's own jitted GRPO step (`knitjax.train.step.compile_train_step`: the
micro-batch scan, the clipped policy loss, AdamW, donation) on random weights and random
full-length rows; the sampler is `knitjax.rollout.sampler.Sampler` (prefill, then one jitted
decode loop over the KV cache) with an end token that never comes, so every row decodes
``new_tokens`` tokens. Each is compiled once, run ``warmup`` times, then timed over ``steps``
calls (median).

FLOPs per trained token, as PaLM counts them (Chowdhery et al. 2022, appendix B; `lab.flops`):
``6 N + 12 L H Q T``, with N the params of every matmul (attention and MLP projections and the
unembedding; the input embedding is a lookup), L layers, H query heads, Q the head dim and T the
sequence length. The attention term counts the full T x T scores, as PaLM does (a causal kernel
skips about half). Every position of a row is trained (the forward and backward run over all T
tokens; the loss mask only zeroes the prompt's terms). MFU = trained tokens/s x FLOPs per token /
the device's peak FLOP/s (``config.peak_tflops`` per device, e.g. 989 for one H200's dense
bf16); with no peak stated (the CPU) MFU is left out (null) and the achieved FLOP/s is reported.

Usage: python -m lab.bench --config configs/bench/mfu.py[:cpu|:quick] --workdir DIR
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
from flax import nnx

from knitjax import sharding
from knitjax.models.transformer import Transformer, TransformerConfig
from knitjax.rollout.sampler import Sampler, SamplingConfig
from knitjax.train import losses
from knitjax.train.batch import make_batch, pad_rows, split_micro_batches
from knitjax.train.optimizer import make_optimizer
from knitjax.train.step import (
  StepHParams,
  batch_shardings,
  compile_train_step,
  init_train_state,
)
from lab.bench.compiled_memory import memory_stats
from lab.bench.report import format_table, write_json
from lab.flops import matmul_params, train_flops_per_token


def _rows(rng, rows: int, seq_len: int, prompt_len: int, vocab: int):
  prompts = [rng.integers(1, vocab, prompt_len).astype(np.int32) for _ in range(rows)]
  new = seq_len - prompt_len
  responses = [rng.integers(1, vocab, new).astype(np.int32) for _ in range(rows)]
  logps = [np.full(new, -np.log(vocab), np.float32) for _ in range(rows)]
  advantages = rng.normal(size=rows).astype(np.float32)
  batch = make_batch(
    pad_rows(prompts, responses, logps),
    advantages,
    prompt_len=prompt_len,
    max_new_tokens=new,
    pad_id=0,
  )
  return batch


def timed(fn, warmup: int, steps: int) -> tuple[float, list[float]]:
  """(seconds of the first call, which may compile; the timed calls' seconds)."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  compile_s = time.perf_counter() - t0
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return compile_s, times


def measure_train(model: TransformerConfig, mesh, config, seq_len: int, weights=None) -> dict:
  """Tokens/s, FLOP/s, MFU and compiled memory of the train step at one sequence length.

  ``weights``: ``(graphdef, params)`` to train (e.g. a checkpoint's, `hf.init_from_hf`; the
  params are donated to the step); by default a random init of ``model``.
  """
  if weights is None:
    weights = sharding.init_sharded(lambda: Transformer(model, rngs=nnx.Rngs(0)), mesh)
  graphdef, params = weights
  optimizer = make_optimizer(_Opt())
  state, shardings = init_train_state(params, optimizer, mesh)
  hparams = StepHParams(
    loss=losses.LossConfig(aggregation="token_mean"), max_new_tokens=seq_len - config.prompt_len
  )
  step = compile_train_step(
    graphdef=graphdef, optimizer=optimizer, hparams=hparams, state_shardings=shardings, mesh=mesh
  )
  rng = np.random.default_rng(0)
  host = split_micro_batches(
    _rows(rng, config.rows, seq_len, config.prompt_len, model.vocab_size), config.micro_batches
  )
  batch = jax.device_put(host, batch_shardings(mesh))
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - t0
  box = {"state": state}

  def one():
    with jax.set_mesh(mesh):
      box["state"], metrics = step(box["state"], batch)
    return metrics["loss"]

  first_s, times = timed(one, config.warmup, config.steps)
  seconds = float(np.median(times))
  tokens = config.rows * seq_len
  flops = train_flops_per_token(model, seq_len) * tokens / seconds
  peak = config.peak_tflops * 1e12 * mesh.size if config.peak_tflops else None
  return {
    "seq_len": seq_len,
    "rows": config.rows,
    "micro_batches": config.micro_batches,
    "step_s": seconds,
    "step_s_all": times,
    "compile_s": compile_s,  # lowering and compiling the step (nothing run)
    "first_call_s": first_s,
    "tokens_per_s": tokens / seconds,
    "tflops_per_s": flops / 1e12,
    "mfu": flops / peak if peak else None,
    "flops_per_token": train_flops_per_token(model, seq_len),
    "peak_bytes": _peak_bytes(compiled),
  }


def _peak_bytes(compiled) -> int | None:
  try:
    return memory_stats(compiled)["peak_bytes"]
  except ValueError:  # a backend without memory analysis: the timings still stand
    return None


def measure_sampler(model: TransformerConfig, mesh, config) -> dict:
  """Generated tokens/s of the sampler: ``sampler_batch`` rows, every one ``new_tokens`` long."""
  graphdef, params = sharding.init_sharded(lambda: Transformer(model, rngs=nnx.Rngs(0)), mesh)
  s = config.sampler
  sampler = Sampler(
    graphdef,
    mesh=mesh,
    sampling=SamplingConfig(max_new_tokens=s.new_tokens, temperature=1.0),
    eos_id=model.vocab_size,  # never sampled: every row decodes new_tokens tokens
    pad_id=0,
    prompt_len=s.prompt_len,
  )
  rng = np.random.default_rng(1)
  prompts = rng.integers(1, model.vocab_size, (s.batch, s.prompt_len)).astype(np.int32)
  lens = np.full(s.batch, s.prompt_len, np.int32)
  key = jax.random.key(0)
  out = {}

  def one():
    out["samples"] = sampler(params, prompts, lens, key)
    return out["samples"].lengths

  first_s, times = timed(one, config.warmup, config.steps)
  generated = int(np.sum(out["samples"].lengths))
  seconds = float(np.median(times))
  return {
    "batch": s.batch,
    "prompt_len": s.prompt_len,
    "new_tokens": s.new_tokens,
    "generated_tokens": generated,
    "call_s": seconds,
    "first_call_s": first_s,  # compiles
    "tokens_per_s": generated / seconds,
  }


class _Opt:
  """AdamW as the trainer builds it (`make_optimizer` reads these fields)."""

  lr, warmup_steps, weight_decay, b1, b2, grad_clip = 1e-6, 0, 0.0, 0.9, 0.999, 1.0


def run(config, workdir: str) -> dict:
  model = TransformerConfig(**config.model)
  mesh = sharding.make_mesh(tuple(config.mesh_shape), devices=jax.devices()[: config.devices])
  for seq_len in config.seq_lens:
    if seq_len <= config.prompt_len:
      raise ValueError(f"seq_lens must exceed prompt_len={config.prompt_len}, got {seq_len}.")
  train = [measure_train(model, mesh, config, t) for t in config.seq_lens]
  sampler = measure_sampler(model, mesh, config) if config.sampler.batch else None
  columns = ["seq_len", "rows", "step_s", "tokens_per_s", "tflops_per_s", "mfu", "compile_s"]
  print(f"train step, {jax.default_backend()} x{mesh.size}, model dtype {model.dtype}:")
  print(format_table(train, columns))
  if sampler:
    print("sampler:")
    print(format_table([sampler], ["batch", "prompt_len", "new_tokens", "call_s", "tokens_per_s"]))
  result = {
    "train": train,
    "sampler": sampler,
    "model": config.model.to_dict(),
    "matmul_params": matmul_params(model),
    "backend": jax.default_backend(),
    "devices": [str(d) for d in mesh.devices.flat],
    "device_kind": jax.devices()[0].device_kind,
    "peak_tflops_per_device": config.peak_tflops or None,
    "jax_version": jax.__version__,
  }
  write_json(workdir, "mfu", result)
  _plot(workdir, train)
  return result


def _plot(workdir: str, train: list[dict]) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(5, 3.5))
  lengths = [str(r["seq_len"]) for r in train]
  ax.bar(lengths, [r["tokens_per_s"] for r in train])
  ax.set_xlabel("sequence length")
  ax.set_ylabel("trained tokens / s")
  mfu = [r["mfu"] for r in train]
  if all(m is not None for m in mfu):
    for i, m in enumerate(mfu):
      ax.annotate(f"MFU {m:.1%}", (i, train[i]["tokens_per_s"]), ha="center", va="bottom")
  ax.set_title("Train step throughput")
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "mfu.png"), dpi=120)
  plt.close(fig)
