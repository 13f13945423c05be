"""The LoRA memory benchmark: compiled train-step memory and bytes, full fine-tuning vs LoRA."""

import dataclasses

import jax

from configs.bench import lora_memory as bench_config
from knitjax import sharding
from knitjax.models.transformer import TransformerConfig
from lab.bench.lora_memory import measure


def test_lora_step_holds_less_than_full_fine_tuning():
  c = bench_config.get_config("quick")
  model = TransformerConfig(**c.model)
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  kwargs = dict(rows=c.rows, seq_len=c.seq_len, micro_batches=c.micro_batches, kl_coef=0.04)
  full = measure(model, mesh, **kwargs)
  lora = measure(dataclasses.replace(model, lora_rank=4, lora_alpha=8.0), mesh, **kwargs)
  # Full fine-tuning trains, optimizes, publishes and copies (as reference) every param.
  assert full["published_bytes"] == full["trained_param_bytes"] == full["reference_copy_bytes"]
  assert full["optimizer_state_bytes"] >= 2 * full["trained_param_bytes"]  # AdamW's moments
  # LoRA: the base is frozen and is the reference (no copy); adapters alone are the rest.
  assert lora["frozen_bytes"] == full["trained_param_bytes"] and lora["reference_copy_bytes"] == 0
  assert lora["published_bytes"] == lora["trained_param_bytes"] < full["trained_param_bytes"] / 4
  assert lora["optimizer_state_bytes"] < full["optimizer_state_bytes"] / 4
  assert lora["argument_bytes"] < full["argument_bytes"]
  assert lora["peak_bytes"] < full["peak_bytes"]
