"""Rollout engine benchmark: group-start stalls and tokens/s of the run's engine against the engine
before chunked prefill and prefix sharing, and the batched sampler (`lab/bench/engine.py`).

Usage:
  python -m lab.bench --config configs/bench/engine.py --workdir /tmp/engine
  python -m lab.bench --config configs/bench/engine.py:quick --workdir /tmp/engine_q  # smoke

Shape: a Qwen3-style decoder (2 layers, d_model 128, ffn 256, 4 heads x 32, 2 KV heads, vocab
512) on one CPU device (the real staleness runs' rollout side); 64 groups x G=8; prompts of 64-128
tokens (GSM8K-like chat prompts are ~100-200); budgets cycling 8, 16, 64 tokens (a long tail, as
the longtail task's classes); 64 slots (8 groups at once), 8 iterations per call, chunks of 64
prompt tokens (the config default), one prefill lane.
"""

import ml_collections

from configs import common


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.bench = "engine"
  c.cpu_devices = 1
  c.devices = 1
  c.seed = 0
  c.model = common.tiny_decoder(vocab_size=512, d_model=128, head_dim=32, ffn_dim=256)
  c.groups = 64
  c.group_size = 8
  c.prompt_len = 128
  c.prompt_min = 64
  c.max_new_tokens = 64
  c.budgets = (8, 16, 64)
  c.slots = 64
  c.decode_steps = 8
  c.prefill_chunk = 64
  c.lanes = 1
  c.rounds = 3
  c.version_every = 4  # new_groups engines get a new version every 4 calls (0: skip them)
  if arg in (None, ""):
    return c
  if arg == "quick":
    c.model = common.tiny_decoder(vocab_size=32)
    c.groups = 6
    c.group_size = 2
    c.prompt_len = 8
    c.prompt_min = 2
    c.max_new_tokens = 6
    c.budgets = (2, 6)
    c.slots = 4
    c.decode_steps = 2
    c.prefill_chunk = 4
    c.rounds = 1
    return c
  raise ValueError(f"engine config arg={arg!r} is not accepted; use '' or 'quick'.")
