"""Compute dtypes by the names configs use, and what "auto" means on this machine."""

import jax
import jax.numpy as jnp

from knitjax import jax_compat

# Compute dtypes a model may run in, by the name configs use (`TransformerConfig.dtype`).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# "auto" in a config's dtype: the backend's default compute dtype (`resolve_dtype`).
AUTO_DTYPE = "auto"


def resolve_dtype(name: str) -> str:
  """The compute dtype a config's ``dtype`` names; ``"auto"``: bfloat16 on TPU and GPU (the
  accelerator default: params, gradients and optimizer state stay float32, only compute is
  bf16), float32 on the CPU (exact tests, and no bf16 matmul units to gain from)."""
  if name != AUTO_DTYPE:
    return name
  return "bfloat16" if _accelerator() else "float32"


# Packages that give JAX a TPU or GPU backend when installed.
_ACCELERATOR_PLUGINS = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin")


def _accelerator() -> bool:
  """Whether JAX runs (or will run) on a TPU or GPU, without starting a backend if none has
  started: configs are read before `jax.distributed.initialize`, which must come first."""
  import importlib.util
  import os

  if jax_compat.backends_started():
    return jax.default_backend() in ("tpu", "gpu")
  platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    first = platforms.split(",")[0].strip()
    return first in ("tpu", "gpu", "cuda", "rocm")
  return any(importlib.util.find_spec(name) for name in _ACCELERATOR_PLUGINS)
