"""Defaults the training configs share: the tiny decoder, the GRPO settings, and
:func:`complete`, which gives a config every field the typed views know.

Configs import it as ``from configs import common`` (like big_vision's ``configs/common.py``),
so run from the repository root, as every usage line says. Each function returns a fresh dict;
keyword arguments replace or add fields.
"""

import dataclasses

import ml_collections


def tiny_decoder(*, vocab_size: int, **changes) -> dict:
  """A Qwen3-style decoder from random init: 2 layers, d_model 64, 4 heads x 16, 2 KV heads."""
  model = dict(
    vocab_size=vocab_size,
    num_layers=2,
    d_model=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    ffn_dim=128,
    qk_norm=True,
    tie_embeddings=True,
    dtype="auto",  # bf16 compute on TPU/GPU, float32 on the CPU
  )
  return model | changes


def grpo() -> dict:
  """GRPO settings that learn the tiny tasks from random init, as the sections ``optimizer``,
  ``loss`` and ``layout`` (``c.update(common.grpo())``): lr 1e-3, warmup 10, token-mean, entropy
  bonus 0.01, one micro-batch."""
  return dict(
    optimizer=dict(lr=1e-3, warmup_steps=10, grad_clip=1.0),
    loss=dict(advantage="grpo", aggregation="token_mean", entropy_coef=0.01),
    layout=dict(micro_batches=1),
  )


def complete(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Adds every field of every section at its default (`knitjax.config`), so that any documented
  field can be set from the command line on a shipped config (``--config.topology.storage=ray``,
  ``--config.init_from=DIR``); fields the config sets keep their values."""
  from knitjax import config as typed

  for name, cls in typed.SECTIONS.items():
    given = c[name].to_dict() if name in c else {}
    defaults = {
      f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
      for f in dataclasses.fields(cls)
      if f.init
    }
    c[name] = {**defaults, **given}
  if "init_from" not in c:
    c.init_from = ""
  return c
