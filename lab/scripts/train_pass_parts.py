"""Where SmolLM2-135M's train pass spends its time: one micro-batch's parts, timed apart.

  python -m lab.scripts.train_pass_parts

On one micro-batch of ``--rows`` x ``--seq_len`` random tokens (float32, the converted
SmolLM2-135M-Instruct; speed does not depend on the token values) it times, each as its own
jitted function (median of ``--calls`` after one untimed call): the decoder body's forward, the
forward with the chunked log-probs of the targets (the loss's forward), the gradient of the body
alone, and the gradient of the summed log-probs (the loss's forward and backward). Each row's
GFLOP/s counts 2 x params x tokens per forward and twice that per backward (`lab.flops`).
docs/real_model.md reads the train pass against these parts (`jax.profiler.trace` shows a CPU
executable as one event, so the parts are timed apart instead).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from knitjax import sharding
from knitjax.models import gguf_cache, hf
from knitjax.train import step
from lab import flops
from lab.bench import mfu


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--seq_len", type=int, default=256)
  ap.add_argument("--calls", type=int, default=3)
  args = ap.parse_args()
  mesh = sharding.make_mesh((1, -1, 1))
  model, graphdef, params = hf.init_from_hf(gguf_cache.smollm2_folder(), mesh, dtype="float32")
  rng = np.random.default_rng(0)
  shape = (args.rows, args.seq_len)
  mb = {
    "tokens": jnp.asarray(rng.integers(0, model.vocab_size, shape), jnp.int32),
    "positions": jnp.broadcast_to(jnp.arange(args.seq_len, dtype=jnp.int32), shape),
    "valid": jnp.ones(shape, bool),
    "targets": jnp.asarray(rng.integers(0, model.vocab_size, shape), jnp.int32),
  }

  def body(p):
    return nnx.merge(graphdef, p).hidden_states(mb["tokens"], mb["positions"], mb["valid"])

  def logp(p):
    return step.forward(nnx.merge(graphdef, p), mb, temperature=1.0, entropy="none")[0]

  tokens = args.rows * args.seq_len
  n_all = flops.matmul_params(model)
  n_body = n_all - model.vocab_size * model.d_model  # without the output projection

  def train(n):
    return flops.matmul_flops(n, 1, passes=flops.TRAIN_PASSES)

  parts = (
    ("body forward", body, flops.matmul_flops(n_body, 1)),
    ("body + log-probs forward", logp, flops.matmul_flops(n_all, 1)),
    ("body forward + backward", jax.grad(lambda p: body(p).sum()), train(n_body)),
    ("body + log-probs forward + backward", jax.grad(lambda p: logp(p).sum()), train(n_all)),
  )
  print(f"one micro-batch: {args.rows} rows x {args.seq_len} tokens, float32")
  with jax.set_mesh(mesh):
    for name, fn, flops_per_token in parts:
      f = jax.jit(fn)
      s = float(np.median(mfu.timed(lambda f=f: f(params), warmup=0, steps=args.calls)[1]))
      print(f"{name}: {s:.2f} s, {flops_per_token * tokens / s / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
  main()
