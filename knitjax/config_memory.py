"""A lower bound on the memory a run needs, checked against this machine's before anything runs.

A config whose step holds more samples than the machine can store (``rollout.group_size=2**20``
of a tiny model: hundreds of GB of activations) would otherwise hang or try the allocation after
a minute of building. :func:`check_memory` refuses it in one sentence first. The estimate counts
only what the step cannot avoid holding, in bfloat16 unless the model is float32, so it refuses
only what clearly cannot fit; it is compared with the host's physical memory (the CPU's devices
live there; on an accelerator, the host holds at least the step's records).
"""

from __future__ import annotations

import os

from knitjax.config import Config

GB = 1e9


def host_memory_bytes() -> int | None:
  """Physical memory of this machine, or None where the OS does not say."""
  try:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (AttributeError, OSError, ValueError):
    return None


def estimate_bytes(config: Config) -> int:
  """The least memory one train step of ``config`` holds at once: the step's token records on the
  host, plus the larger of the rollout's KV cache and one micro-batch's saved activations."""
  r, a, m = config.rollout, config.admission, config.model
  prompt = max(config.task.prompt_len, 1)  # 0 means the task's own length: at least one token
  width = 4 if m.dtype == "float32" else 2  # "auto" may be bfloat16
  # A group's prompt laid out once (layout.prompt_sharing="group"): the fewest tokens of a layout.
  step_tokens = a.groups_per_step * (prompt + r.group_size * r.max_new_tokens)
  records = step_tokens * 8  # a token id and its log-prob, int32 and float32
  micro_tokens = step_tokens // (a.minibatches * config.layout.micro_batches)
  # Per token and layer the backward pass keeps the block's input, with remat="block" only that;
  # otherwise also its residual, queries and the MLP's gate and up projections.
  kept = m.d_model
  if m.remat != "block":
    kept = 2 * m.d_model + m.num_heads * m.head_dim + 2 * m.ffn_dim
  train = micro_tokens * m.num_layers * kept * width
  kv = _rows_at_once(config) * (prompt + r.max_new_tokens) * _kv_per_token(config) * width
  return records + max(train, kv)


def _rows_at_once(config: Config) -> int:
  """Samples one rollout call generates: the continuous engine's slots, a colocated step's every
  sample, or a disaggregated wave of ``slots // group_size`` groups (one at least)."""
  r, a = config.rollout, config.admission
  if r.engine == "continuous":
    return r.slots
  if config.topology.mode == "colocated":
    return a.groups_per_step * r.group_size
  return max(1, r.slots // r.group_size) * r.group_size


def _kv_per_token(config: Config) -> int:
  m = config.model
  return 2 * m.num_layers * m.num_kv_heads * m.head_dim  # keys and values


def check_memory(config: Config, *, processes: int = 1, memory: int | None = None) -> None:
  """Raises ValueError (one sentence) when one train step needs more than this machine's memory.

  ``processes``: the run's JAX processes, each holding its share of the step; ``memory``: the
  machine's bytes (default: :func:`host_memory_bytes`; nothing is checked where it is unknown).
  """
  memory = host_memory_bytes() if memory is None else memory
  if not memory:
    return
  need = estimate_bytes(config) // max(processes, 1)
  if need <= memory:
    return
  r, a = config.rollout, config.admission
  raise ValueError(
    f"config.rollout.group_size={r.group_size} with config.rollout.max_new_tokens="
    f"{r.max_new_tokens} and {a.groups_per_step} groups per step (config.admission.quotas) needs "
    f"an estimated {need / GB:,.0f} GB of memory, more than this machine's {memory / GB:,.0f} GB; "
    "lower them."
  )
