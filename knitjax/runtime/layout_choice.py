"""The config's choice of training layout (`knitjax.train.layouts`): which layout a run's trainer
and its preparers lay mini-batches out with, and the shapes the step compiles for it. Adding a
layout is its class in `knitjax.train.layouts` and one line in :func:`build_layout`."""

from __future__ import annotations

import jax

from knitjax.config import Config
from knitjax.train import layouts, mm_step, packing, prefix, prompt_sharing


def shared_spans(config: Config, prompt_len: int) -> tuple[int, int] | None:
  """``(P, N)`` of the fixed-span shared-prompt rows the step takes, or None (padded or packed
  rows, or an unknown prompt width)."""
  if config.layout.prompt_sharing != "group" or config.layout.packing != "off" or not prompt_len:
    return None
  return (prompt_len, config.rollout.max_new_tokens)


def build_layout(config: Config, mesh, prompt_len: int) -> layouts.Layout:
  """How the trainer lays out mini-batches (`knitjax.train.layouts`): with shared prompts
  (``config.layout.prompt_sharing`` "group", packed or not), each prompt once per mini-batch
  beside its rows ("prefix"), packed (``config.layout.packing``), or padded rows; a VLM's images
  one per row when its encoder runs per row (``config.vlm.encoder_dedup`` off), else each unique
  image once.

  ``pack_len`` 0 takes the padded row length (``prompt_len + max_new_tokens``), which every row
  fits, or with shared prompts a whole group's (``prompt_len + group_size * max_new_tokens``);
  the sequence count is rounded to the micro-batches times the mesh's batch shards.
  """
  multiple = config.layout.micro_batches * mm_step.batch_shards(mesh)
  n = config.rollout.max_new_tokens
  row_images = config.vision is not None and not config.vlm.encoder_dedup
  sharing = prompt_sharing_mode(config, prompt_len)
  if sharing == "group":
    spec = prompt_sharing.ShareSpec(
      prompt_len=prompt_len,
      seq_len=config.layout.pack_len or prompt_len + config.rollout.group_size * n,
      multiple=multiple,
      pack=config.layout.packing == "pack",
    )
    return layouts.Shared(spec, row_images=row_images)
  if sharing == "prefix":
    spec = prefix.PrefixSpec(prompt_len, prefix_slots(config, mesh))
    return layouts.SharedPrefix(spec, row_images=row_images)
  if config.layout.packing == "pack":
    spec = packing.PackSpec(
      pack_len=config.layout.pack_len or prompt_len + n,
      multiple=multiple,
      buckets=config.layout.pack_buckets,
    )
    return layouts.Packed(spec, row_images=row_images)
  return layouts.Padded(row_images=row_images)


def prompt_sharing_mode(config: Config, prompt_len: int) -> str:
  """``config.layout.prompt_sharing`` with "auto" decided: "prefix" (each prompt once per
  mini-batch, `knitjax.train.prefix`) where it applies, else "off".

  The rule, as measured (docs/prompt_sharing.md): "prefix" gave the padded layout's learning
  metrics (arith_tiny, 20 steps, rtol 1e-4) and was faster at every point measured on the CPU
  (1.12x-2.53x a step, P 256-2048, R 512-2048, G 8-16; arith_tiny's update 1.8x). It needs
  padded rows (no packing), a group of more than one sample, a prompt of at least 2 tokens and
  one trainer process (`layouts.SharedPrefix.for_consumers`). It is not chosen for a VLM (a
  prompt ending in an image token is not checked there; not measured) nor where the attention
  is a fused GPU/TPU kernel (cuDNN or splash), which rows that continue a prompt's keys replace
  by the blockwise path (not measured on an accelerator). "auto" never chooses "group".
  """
  mode = config.layout.prompt_sharing
  if mode != "auto":
    return mode
  kernel = jax.default_backend() != "cpu" and config.model.attention not in ("xla", "dense")
  applies = (
    config.layout.packing == "off"
    and config.vision is None
    and jax.process_count() == 1
    and config.rollout.group_size > 1
    and prompt_len >= 2
    and not kernel
  )
  return "prefix" if applies else "off"


def prefix_slots(config: Config, mesh) -> int:
  """Prompts a mini-batch lays out once (`knitjax.train.prefix`): its groups, rounded up to a
  multiple of the mesh's batch shards (the prompts are split over them)."""
  a = config.admission
  groups = a.groups_per_step // a.minibatches
  shards = mm_step.batch_shards(mesh)
  return -(-groups // shards) * shards
