#!/usr/bin/env bash
# One H200: train-step MFU and sampler tokens/s at the Qwen2.5-0.5B shape (configs/bench/mfu.py).
#
# Usage, from the repository root of a machine with one NVIDIA GPU:
#   bash lab/scripts/device/h200.sh [OUT_DIR]      (default OUT_DIR: docs/device/h200)
#
# It uses the machine's JAX if that JAX sees a GPU (an image with jax + a CUDA plugin), else
# installs `jax[cuda12]` from the package registry; ml-collections (the configs) is installed from
# ./.whl if that folder holds wheels (machines with no registry), else from the registry. Then the
# MFU benchmark runs once (T = 2048 and 4096, then the sampler) under a 7.5-minute limit and its
# JSON, plot and log land in OUT_DIR, with nvidia-smi's view of the GPU.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT_DIR="${1:-docs/device/h200}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"

if ! "$PY" -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 1)" 2>/dev/null; then
  echo "installing jax[cuda12] (the machine's JAX sees no GPU)"
  "$PY" -m pip install -q -U "jax[cuda12]"
fi
if ! "$PY" -c "import ml_collections" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    "$PY" -m pip install -q ml-collections
  fi
fi

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
  > "$OUT_DIR/nvidia_smi.csv" || true
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$OUT_DIR/env.txt"

# XLA's preallocation off: the benchmark's memory figures are what XLA plans, not 75% of HBM.
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" timeout 450 "$PY" -m lab.bench \
  --config configs/bench/mfu.py --workdir "$OUT_DIR" 2>&1 | tee "$OUT_DIR/mfu.log"
echo "wrote $OUT_DIR/mfu.json"
