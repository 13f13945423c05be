"""Float32 GFLOP/s of jitted matmuls of SmolLM2-135M's shapes beside the 2048^3 ceiling.

  python -m lab.scripts.matmul_shapes

Each product is one `jax.jit(lambda a, b: a @ b)`, timed over ``--calls`` calls after one
untimed call; the median is reported. docs/real_model.md reads the train pass and the decode step
against these figures (m = 2048: a micro-batch of 8 rows x 256 tokens; m = 32: one decode step).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from lab.bench import mfu

SHAPES = (
  ((2048, 2048, 2048), "the ceiling"),
  ((2048, 576, 1536), "MLP up, one micro-batch"),
  ((2048, 1536, 576), "MLP down, one micro-batch"),
  ((2048, 576, 576), "q, o"),
  ((2048, 576, 192), "k, v"),
  ((2048, 576, 49152), "the output projection"),
  ((32, 576, 1536), "MLP up, one decode step"),
  ((32, 576, 49152), "the output projection, one decode step"),
)


def gflops(m: int, k: int, n: int, calls: int) -> float:
  """Median GFLOP/s of ``calls`` timed [m, k] x [k, n] float32 products."""
  a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
  f = jax.jit(lambda a, b: a @ b)
  _, times = mfu.timed(lambda: f(a, b), warmup=0, steps=calls)
  return 2 * m * k * n / float(np.median(times)) / 1e9


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--calls", type=int, default=5)
  args = ap.parse_args()
  for (m, k, n), what in SHAPES:
    print(f"{m} x {k} x {n}  {what}: {gflops(m, k, n, args.calls):.1f} GFLOP/s")


if __name__ == "__main__":
  main()
