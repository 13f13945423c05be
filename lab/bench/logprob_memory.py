"""Memory of the log-prob + entropy computation, whole logits vs chunked, from XLA's analysis.

For each sequence length and each ``chunk`` (0: whole logits, the plain path) the function
``(hidden [b, T, D] compute dtype, table [V, D] float32, targets [b, T]) -> (logp, entropy)`` of
:func:`knitjax.train.logprobs.token_logprobs_and_entropy` is compiled twice
(:func:`lab.bench.compiled_memory.compiled_memory`; nothing runs): the forward alone, and
forward + backward (the gradient of ``sum(logp) + sum(entropy)`` w.r.t. hidden states and table,
entropy as a loss term: the most the train step asks). The figures are ``temp_bytes`` (what
the log-prob path itself allocates: logits, softmax, the table's gradient accumulator) and
``peak_bytes`` (also the arguments and outputs, which both paths share).

Usage: python -m lab.bench --config configs/bench/logprob_memory.py --workdir DIR
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from knitjax.models import dtypes
from knitjax.train.logprobs import token_logprobs_and_entropy
from lab.bench.compiled_memory import MIB, compiled_memory
from lab.bench.report import format_table, write_json


def _fns(chunk: int, temperature: float):
  """The forward and the forward + backward of one setting, as jittable functions."""

  def fwd(hidden, table, targets):
    return token_logprobs_and_entropy(
      hidden, table, targets, table_axes="vd", temperature=temperature, chunk=chunk, entropy="loss"
    )

  def loss(hidden, table, targets):
    logp, ent = fwd(hidden, table, targets)
    return jnp.sum(logp) + jnp.sum(ent)

  return fwd, jax.grad(loss, argnums=(0, 1))


def measure(*, vocab: int, d_model: int, seq_len: int, rows: int, chunk: int, dtype: str,
            temperature: float = 1.0) -> dict:  # fmt: skip
  """Compiled memory of one setting's forward and forward + backward."""
  shapes = (
    jax.ShapeDtypeStruct((rows, seq_len, d_model), dtypes.DTYPES[dtype]),
    jax.ShapeDtypeStruct((vocab, d_model), jnp.float32),
    jax.ShapeDtypeStruct((rows, seq_len), jnp.int32),
  )
  fwd, fwd_bwd = _fns(chunk, temperature)
  out = {}
  for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
    got = compiled_memory(fn, *shapes)
    out[f"{name}_temp_bytes"] = got["temp_bytes"]
    out[f"{name}_peak_bytes"] = got["peak_bytes"]
  out["logits_bytes"] = rows * seq_len * vocab * 4  # the float32 [b, T, V] of the plain path
  return out


def run(config, workdir: str) -> dict:
  rows = []
  for seq_len in config.seq_lens:
    plain = None
    for chunk in (0, *config.chunks):
      got = measure(
        vocab=config.vocab, d_model=config.d_model, seq_len=seq_len, rows=config.rows,
        chunk=chunk, dtype=config.dtype,
      )  # fmt: skip
      row = {"seq_len": seq_len, "chunk": chunk, **got}
      plain = plain or row
      for k in ("fwd_temp", "fwd_peak", "fwd_bwd_temp", "fwd_bwd_peak"):
        row[f"{k}_cut"] = plain[f"{k}_bytes"] / max(row[f"{k}_bytes"], 1)
      rows.append(row)
  mib = [{k: v / MIB if k.endswith("_bytes") else v for k, v in r.items()} for r in rows]
  columns = ["seq_len", "chunk", "fwd_temp_bytes", "fwd_bwd_temp_bytes", "fwd_bwd_peak_bytes",
             "fwd_temp_cut", "fwd_bwd_temp_cut", "fwd_bwd_peak_cut"]  # fmt: skip
  print(
    f"MiB (V={config.vocab}, D={config.d_model}, rows={config.rows}, {config.dtype} hidden, "
    f"float32 table; chunk 0 = whole logits; cut = plain / chunked):"
  )
  print(format_table(mib, columns))
  result = {
    "rows_table": rows,
    "vocab": config.vocab,
    "d_model": config.d_model,
    "rows": config.rows,
    "dtype": config.dtype,
    "seq_lens": list(config.seq_lens),
    "chunks": list(config.chunks),
    "backend": jax.default_backend(),
  }
  write_json(workdir, "logprob_memory", result)
  _plot(workdir, rows)
  return result


def _plot(workdir: str, rows: list[dict]) -> None:
  import os

  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
  seq_lens = sorted({r["seq_len"] for r in rows})
  chunks = sorted({r["chunk"] for r in rows})
  width = 0.8 / len(chunks)
  for ax, part in zip(axes, ("fwd_temp_bytes", "fwd_bwd_temp_bytes"), strict=True):
    for i, chunk in enumerate(chunks):
      values = [
        next(r[part] for r in rows if r["seq_len"] == t and r["chunk"] == chunk) / MIB
        for t in seq_lens
      ]
      label = "whole logits" if chunk == 0 else f"chunk {chunk}"
      ax.bar(np.arange(len(seq_lens)) + i * width, values, width, label=label)
    ax.set_xticks(np.arange(len(seq_lens)) + 0.4 - width / 2, [f"T={t}" for t in seq_lens])
    ax.set_title(part.removesuffix("_temp_bytes").replace("_", "+") + " temporaries")
  axes[0].set_ylabel("MiB")
  axes[0].legend()
  fig.suptitle("Log-probs + entropy memory (XLA memory analysis)")
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "logprob_memory.png"), dpi=120)
  plt.close(fig)
