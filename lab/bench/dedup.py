"""Encoder-dedup benchmark: the same multimodal train step with and without deduplication.

Workload (configs/bench/dedup.py): a mini-batch of ``unique_images`` groups of G responses, one
image per group, split into K micro-batches with every group's members spread over all of them
(rows interleaved: micro-batch k holds members k, k + K, ... of each group). Three compiled steps
(AdamW, identical params and batch) are timed:

- ``naive``: each micro-batch encodes its rows' images (rows images per mini-batch, K encoder
  backwards);
- ``dedup``: unique images encoded once, cotangents accumulated, one encoder backward;
- ``dedup_remat``: dedup with the encoder rematerialised in its backward.

Images encoded and encoder backwards are the steps' own counts (``knitjax.train.dedup.COUNT_KEYS``,
counted by the encoder calls that ran), not shapes of the workload.

The encoder's share of the naive step is measured by difference: the decoder's text train step
on the same rows (the backbone alone) is timed too, and ``naive - backbone`` is the encoder's
in-step cost. If that cost scales with the images encoded (counted: R naive, U dedup), dedup
takes ``backbone + (naive - backbone) U / R``; the JSON reports that prediction next to the
measurement, and, for reference, the encoder's forward + backward timed alone. Measurements are
interleaved round by round (every step, then the encoder alone), so a busy machine slows all
alike. Peak memory is XLA's compiled estimate (``memory_analysis``: arguments + outputs +
temporaries - aliased), where the backend gives one.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from knitjax import sharding
from knitjax.models.transformer import Transformer, TransformerConfig
from knitjax.models.vision import VisionConfig
from knitjax.models.vlm import VLM, split_params
from knitjax.train import losses, mm_step
from knitjax.train.batch import make_batch, pad_rows
from knitjax.train.dedup import COUNT_KEYS
from knitjax.train.step import (
  MICRO_BATCH_FIELDS,
  StepHParams,
  compile_train_step,
  init_train_state,
)
from knitjax.train.step import batch_shardings as text_batch_shardings
from lab.bench.compiled_memory import memory_stats
from lab.bench.report import format_table, write_json

IMAGE_TOKEN = 3
PATHS = {
  "naive": dict(encoder_dedup=False, remat_encoder=False),
  "dedup": dict(encoder_dedup=True, remat_encoder=False),
  "dedup_remat": dict(encoder_dedup=True, remat_encoder=True),
}


def make_workload(
  *,
  lm: TransformerConfig,
  vision: VisionConfig,
  unique_images: int,
  group_size: int,
  micro_batches: int,
  text_tokens: int,
  response_tokens: int,
  seed: int = 0,
) -> dict[str, np.ndarray]:
  """A mini-batch in the multimodal step's host layout, group members spread over micro-batches."""
  if (unique_images * group_size) % micro_batches:
    raise ValueError(
      f"unique_images * group_size = {unique_images * group_size} rows cannot be split into "
      f"micro_batches={micro_batches} equal micro-batches."
    )
  rng = np.random.default_rng(seed)
  s = vision.image_size
  images = rng.integers(0, 256, (unique_images, s, s, vision.channels)).astype(np.uint8)
  prompts, responses, logps, index = [], [], [], []
  for g in range(unique_images):
    text = rng.integers(4, lm.vocab_size, text_tokens)
    prompt = np.concatenate([[1], [IMAGE_TOKEN] * vision.num_image_tokens, text]).astype(np.int32)
    for _ in range(group_size):
      prompts.append(prompt)
      responses.append(rng.integers(4, lm.vocab_size, response_tokens).astype(np.int32))
      logps.append(rng.normal(-3.0, 0.5, response_tokens).astype(np.float32))
      index.append(g)
  rows = len(prompts)
  batch = make_batch(
    pad_rows(prompts, responses, logps),
    rng.normal(size=rows).astype(np.float32),
    prompt_len=len(prompts[0]),
    max_new_tokens=response_tokens,
    pad_id=0,
  )
  batch["image_index"] = np.asarray(index, np.int32)
  # Row r of group g goes to micro-batch r % K: every group meets every micro-batch.
  order = np.argsort(np.arange(rows) % group_size % micro_batches, kind="stable")
  batch = {k: v[order] for k, v in batch.items()}
  batch["images"] = images
  return batch


def _memory(compiled) -> dict[str, int] | None:
  try:
    m = memory_stats(compiled)
  except Exception:  # noqa: BLE001 - not every backend implements it
    return None
  return {"temp_bytes": m["temp_bytes"], "peak_bytes": m["peak_bytes"]}


def _encoder_fn(graphdef, params, images, mesh):
  """Compiled encoder + projector forward and backward on `images` alone, and its arguments."""
  enc, backbone = split_params(params)

  def fwd_bwd(enc_params, images):
    def f(p):
      return nnx.merge(graphdef, p, backbone).encode_images(images)

    feats, vjp = jax.vjp(f, enc_params)
    return vjp(jnp.ones_like(feats))[0]

  images = jax.device_put(images, sharding.batch_sharding(mesh, 4))
  with jax.set_mesh(mesh):
    return jax.jit(fwd_bwd).lower(enc, images).compile(), (enc, images)


def run(config, workdir: str) -> dict:
  """Runs the benchmark; writes ``dedup.json`` and ``dedup.png``, prints a table."""
  lm = TransformerConfig(**config.model.to_dict())
  vision = VisionConfig(**config.vision.to_dict())
  w = config.workload
  batch = make_workload(
    lm=lm,
    vision=vision,
    unique_images=w.unique_images,
    group_size=w.group_size,
    micro_batches=w.micro_batches,
    text_tokens=w.text_tokens,
    response_tokens=w.response_tokens,
    seed=config.seed,
  )
  rows = len(batch["advantages"])
  devices = jax.devices()[: config.devices] if config.devices else jax.devices()
  mesh = sharding.make_mesh(tuple(config.mesh_shape), devices=devices)
  host = mm_step.prepare_batch(batch, w.micro_batches, shards=mm_step.batch_shards(mesh))
  shardings = mm_step.batch_shardings(mesh)
  dev_batches = {  # the naive step takes one image per row (mm_step.prepare_batch's row_images)
    name: jax.device_put(
      mm_step.prepare_batch(
        batch,
        w.micro_batches,
        shards=mm_step.batch_shards(mesh),
        row_images=not options["encoder_dedup"],
      ),
      shardings,
    )
    for name, options in PATHS.items()
  }
  graphdef, params = sharding.init_sharded(
    lambda: VLM(lm, vision, image_token_id=IMAGE_TOKEN, rngs=nnx.Rngs(config.seed)), mesh
  )
  hparams = StepHParams(loss=losses.LossConfig(entropy_coef=0.01), max_new_tokens=w.response_tokens)
  optimizer = optax.adamw(1e-4)

  steps, states, info = {}, {}, {}
  for name, options in PATHS.items():
    state, shardings = init_train_state(jax.tree.map(jnp.copy, params), optimizer, mesh)
    step = mm_step.compile_mm_train_step(
      graphdef=graphdef,
      optimizer=optimizer,
      hparams=hparams,
      state_shardings=shardings,
      mesh=mesh,
      **options,
    )
    with jax.set_mesh(mesh):
      t0 = time.perf_counter()
      steps[name] = step.lower(state, dev_batches[name]).compile()
      info[name] = {"compile_s": time.perf_counter() - t0, "memory": _memory(steps[name])}
      states[name], metrics = steps[name](state, dev_batches[name])  # warm-up
    metrics = jax.device_get(metrics)
    info[name].update({k: float(metrics[k]) for k in COUNT_KEYS})
    info[name]["loss"] = float(metrics["loss"])
  # The backbone alone: the decoder's text train step on the same rows (placeholders embedded as
  # ordinary tokens), so naive - backbone is what the encoder costs inside the naive step.
  lm_graphdef, lm_params = sharding.init_sharded(
    lambda: Transformer(lm, rngs=nnx.Rngs(config.seed)), mesh
  )
  lm_state, lm_shardings = init_train_state(lm_params, optimizer, mesh)
  lm_batch = jax.device_put({k: host[k] for k in MICRO_BATCH_FIELDS}, text_batch_shardings(mesh))
  with jax.set_mesh(mesh):
    steps["backbone"] = (
      compile_train_step(
        graphdef=lm_graphdef,
        optimizer=optimizer,
        hparams=hparams,
        state_shardings=lm_shardings,
        mesh=mesh,
      )
      .lower(lm_state, lm_batch)
      .compile()
    )
    states["backbone"], _ = steps["backbone"](lm_state, lm_batch)
  # The encoder alone, for reference: what the naive step runs K times (one micro-batch's rows)
  # and what the dedup step runs once (the unique images).
  row_images = np.asarray(host["images"])[np.asarray(host["image_index"][0])]
  enc_mb, enc_mb_args = _encoder_fn(graphdef, params, row_images, mesh)
  enc_u, enc_u_args = _encoder_fn(graphdef, params, host["images"], mesh)
  jax.block_until_ready((enc_mb(*enc_mb_args), enc_u(*enc_u_args)))

  # Rounds interleave every measurement, so a busy machine slows all of them alike.
  batches = {**dev_batches, "backbone": lm_batch}
  times = {name: [] for name in (*steps, "encoder_micro_batch", "encoder_unique")}
  with jax.set_mesh(mesh):
    for _ in range(config.repeats):
      for name, compiled in steps.items():
        t = time.perf_counter()
        states[name], _ = compiled(states[name], batches[name])
        jax.block_until_ready(states[name])
        times[name].append(time.perf_counter() - t)
      for name, fn, args in (
        ("encoder_micro_batch", enc_mb, enc_mb_args),
        ("encoder_unique", enc_u, enc_u_args),
      ):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times[name].append(time.perf_counter() - t)
  med = {k: float(np.median(v)) for k, v in times.items()}
  for name in PATHS:
    info[name]["step_s"] = med[name]
    info[name]["step_s_all"] = times[name]

  naive_s, dedup_s, backbone_s = med["naive"], med["dedup"], med["backbone"]
  share = (naive_s - backbone_s) / naive_s
  # If the encoder's in-step cost scales with the images it encodes (as counted: R naive, U dedup):
  encoded = {k: r["encoder_images_encoded"] for k, r in info.items()}
  predicted = backbone_s + (naive_s - backbone_s) * encoded["dedup"] / encoded["naive"]
  result = {
    "workload": {
      "unique_images": w.unique_images,
      "group_size": w.group_size,
      "rows": rows,
      "micro_batches": w.micro_batches,
      "image_tokens": vision.num_image_tokens,
      "sequence_len": int(host["tokens"].shape[-1]),
      "mesh": dict(mesh.shape),
      "vision": config.vision.to_dict(),
      "model": config.model.to_dict(),
      "repeats": config.repeats,
    },
    "naive_s": naive_s,
    "dedup_s": dedup_s,
    "dedup_remat_s": med["dedup_remat"],
    "speedup": naive_s / dedup_s,
    "speedup_remat": naive_s / med["dedup_remat"],
    **{key: {k: r[key] for k, r in info.items()} for key in COUNT_KEYS},
    "peak_memory_bytes": {k: (r["memory"] or {}).get("peak_bytes") for k, r in info.items()},
    "temp_memory_bytes": {k: (r["memory"] or {}).get("temp_bytes") for k, r in info.items()},
    "backbone_s": backbone_s,
    "encoder_in_naive_s": naive_s - backbone_s,
    "encoder_in_dedup_s": dedup_s - backbone_s,
    "encoder_share_naive": share,
    "predicted_dedup_s": predicted,
    "predicted_speedup": naive_s / predicted,
    "encoder_alone_naive_s": w.micro_batches * med["encoder_micro_batch"],
    "encoder_alone_unique_s": med["encoder_unique"],
    "paths": info,
  }
  write_json(workdir, "dedup", result)
  _plot(result, os.path.join(workdir, "dedup.png"))
  table = [
    {
      "path": k,
      "step_s": r["step_s"],
      "images_encoded": int(r["encoder_images_encoded"]),
      "recomputed": int(r["encoder_images_recomputed"]),
      "enc_backwards": int(r["encoder_backward_passes"]),
      "peak_MiB": ((r["memory"] or {}).get("peak_bytes") or 0) / 2**20,
    }
    for k, r in info.items()
  ]
  columns = ["path", "step_s", "images_encoded", "recomputed", "enc_backwards", "peak_MiB"]
  print(format_table(table, columns))
  print(
    f"speedup {result['speedup']:.2f}x (remat {result['speedup_remat']:.2f}x). The backbone alone "
    f"takes {backbone_s:.3f} s, so the encoder is {100 * share:.0f}% of the naive step "
    f"({naive_s - backbone_s:.3f} s for {encoded['naive']:.0f} images); scaled to "
    f"{encoded['dedup']:.0f} images that predicts {result['predicted_speedup']:.2f}x."
  )
  if share <= 0:
    # The subtraction is only meaningful when the encoder costs more than the timing noise.
    print(
      "warning: the naive step timed no slower than the backbone alone, so the encoder's cost is "
      "below this run's timing noise; the share and the prediction above are not meaningful "
      "(use more repeats or a larger encoder)."
    )
  return result


def _plot(result: dict, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(result["paths"])
  step = [result["paths"][n]["step_s"] for n in names]
  fig, ax = plt.subplots(figsize=(6, 3.5))
  bars = ax.bar(names, step, color=["#c44", "#48c", "#8ac"])
  backbone = result["backbone_s"]
  ax.bar(names, [backbone] * len(names), color="#999", label="backbone alone (text step)")
  for bar, n in zip(bars, names, strict=True):
    images = int(result["paths"][n]["encoder_images_encoded"])
    ax.annotate(
      f"{images} images",
      (bar.get_x() + bar.get_width() / 2, bar.get_height()),
      ha="center",
      va="bottom",
    )
  ax.set_ylabel("seconds per mini-batch (median)")
  ax.set_title(f"encoder dedup: {result['speedup']:.2f}x faster train step")
  ax.legend(loc="upper right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
