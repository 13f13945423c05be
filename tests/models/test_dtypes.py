"""Compute dtypes by name: "auto" is bfloat16 on accelerators and float32 on the CPU."""

import jax
import jax.numpy as jnp
import pytest

from knitjax import config as config_lib
from knitjax.models import dtypes
from knitjax.models.transformer import TransformerConfig
from knitjax.models.vision import VisionConfig

SHAPE = dict(vocab_size=8, num_layers=1, d_model=8, num_heads=2, num_kv_heads=1, head_dim=4)


def test_auto_is_float32_on_the_cpu():
  assert dtypes.resolve_dtype("auto") == "float32"
  assert TransformerConfig(**SHAPE, ffn_dim=8, dtype="auto").dtype == "float32"


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_auto_is_bfloat16_on_accelerators(monkeypatch, backend):
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  monkeypatch.setattr(dtypes, "_accelerator", lambda: backend in ("tpu", "gpu"))
  assert dtypes.resolve_dtype("auto") == "bfloat16"
  assert TransformerConfig(**SHAPE, ffn_dim=8, dtype="auto").compute_dtype == jnp.bfloat16
  vision = VisionConfig(dtype="auto")
  assert vision.dtype == "bfloat16"
  assert dtypes.resolve_dtype("float32") == "float32"  # an explicit choice stays


def test_a_config_without_a_dtype_gets_the_backend_default(monkeypatch):
  import configs.arith_tiny

  raw = configs.arith_tiny.get_config().to_dict()
  del raw["model"]["dtype"]
  assert config_lib.from_config_dict(raw).model.dtype == "float32"
  monkeypatch.setattr(dtypes, "_accelerator", lambda: True)
  assert config_lib.from_config_dict(raw).model.dtype == "bfloat16"


def test_an_unknown_dtype_is_refused():
  with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float32'\] or 'auto'"):
    TransformerConfig(**SHAPE, ffn_dim=8, dtype="float16")


def test_auto_does_not_start_a_backend():
  # Configs are read before jax.distributed.initialize, which must precede any backend start.
  code = (
    "from knitjax import jax_compat\n"
    "from knitjax.models import dtypes\n"
    "assert dtypes.resolve_dtype('auto') == 'float32'\n"
    "assert not jax_compat.backends_started()\n"
  )
  import subprocess
  import sys

  env = {k: v for k, v in __import__("os").environ.items() if k != "JAX_PLATFORMS"}
  subprocess.run([sys.executable, "-c", code], check=True, env=env)
