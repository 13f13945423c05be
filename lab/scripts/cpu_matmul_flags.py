"""Does any XLA CPU flag make JAX's matmul use this CPU's bfloat16 hardware? Measured, beside torch.

Each flag set runs in a fresh process (XLA reads ``XLA_FLAGS`` once): a jitted ``N x N x N``
matmul in float32 and bfloat16, ``--calls`` timed calls after a compile, the median's GFLOP/s;
torch's ``@`` the same way, given as many threads as XLA's CPU client uses (its bfloat16 goes
through oneDNN, which uses ``avx512_bf16`` / AMX where the CPU has them). The flag sets are
XLA's CPU paths that exist in the installed jaxlib: oneDNN (``xla_cpu_use_onednn``, its custom
call), XNNPACK and its fusions, YNNPACK's.

Usage: python lab/scripts/cpu_matmul_flags.py [--size 2048] [--calls 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

FLAG_SETS = (
  "",
  "--xla_cpu_use_onednn=true",
  "--xla_cpu_experimental_onednn_custom_call=true",
  "--xla_cpu_use_xnnpack=true",
  "--xla_cpu_experimental_xnn_fusion_type=dot",
  "--xla_cpu_experimental_ynn_fusion_type=dot",
)
DTYPES = ("float32", "bfloat16")


def _median_gflops(call, n: int, calls: int) -> float:
  call()
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    call()
    times.append(time.perf_counter() - t0)
  return 2 * n**3 / sorted(times)[len(times) // 2] / 1e9


def _jax(n: int, calls: int) -> dict[str, float]:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  out = {}
  for dtype in DTYPES:
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    out[dtype] = _median_gflops(lambda f=f, a=a: f(a, a).block_until_ready(), n, calls)
  return out


def _torch(n: int, calls: int) -> dict[str, float] | str:
  try:
    import torch  # noqa: PLC0415
  except ImportError:
    return "not installed: pip install -e .[parity]"
  torch.set_num_threads(len(os.sched_getaffinity(0)))
  out = {}
  for dtype in DTYPES:
    a = torch.ones((n, n), dtype=getattr(torch, dtype))
    out[dtype] = _median_gflops(lambda a=a: a @ a, n, calls)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", type=int, default=2048)
  parser.add_argument("--calls", type=int, default=5)
  parser.add_argument("--out", default="")
  parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
  args = parser.parse_args()
  if args.one:
    print(json.dumps(_jax(args.size, args.calls)))
    return
  rows = {}
  for flags in FLAG_SETS:
    done = subprocess.run(
      [sys.executable, __file__, "--one", f"--size={args.size}", f"--calls={args.calls}"],
      env={**os.environ, "XLA_FLAGS": flags}, capture_output=True, text=True, check=False,
    )  # fmt: skip
    lines = done.stdout.strip().splitlines()
    rows[flags or "(none)"] = json.loads(lines[-1]) if done.returncode == 0 and lines else (
      f"failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    )  # fmt: skip
    print(f"jax {flags or '(none)'}: {rows[flags or '(none)']}", flush=True)
  result = {
    "size": args.size,
    "calls": args.calls,
    "jax": rows,
    "torch": _torch(args.size, args.calls),
  }
  print(f"torch: {result['torch']}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
