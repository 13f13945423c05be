#!/usr/bin/env bash
# Prepares, on a machine with network access, what lab/scripts/device/smollm2_learn.sh needs on a
# GPU machine that reaches no network: the wheels its image lacks, and SmolLM2's GGUF in parts.
#
# Usage, from the repository root, in the venv that runs knitjax (its versions are pinned):
#   bash lab/scripts/device/prepare_carry.sh [PYTHON_VERSION]     (default 3.12, the GPU image's)
#
# Writes (both folders are ignored by .gitignore, so they travel only when carried):
#   .whl/           ml-collections, grain, array-record, portpicker, gguf, tensorboardX: the
#                   packages the GPU image lacks, for CPython PYTHON_VERSION on manylinux x86_64
#   .device_cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part0, .part1 and .sha256
#                   the 98 MB GGUF in two parts of at most 48 MiB: a device call carries at most
#                   64 MiB (working tree included), so the file takes two calls; smollm2_learn.sh
#                   joins the parts and checks the sum.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PYV="${1:-3.12}"
PY="${PYTHON:-python}"
PACKAGES=(ml-collections grain array-record portpicker gguf tensorboardX)

rm -rf .whl && mkdir -p .whl
pins=$("$PY" -c 'import importlib.metadata as m, sys; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' "${PACKAGES[@]}")
platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
# shellcheck disable=SC2086  # the pins are words
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl $pins
ls .whl

GGUF=$("$PY" -c 'from knitjax.models import gguf_cache; print(gguf_cache.smollm2_gguf())')
mkdir -p .device_cache/gguf
NAME=$(basename "$GGUF")
rm -f ".device_cache/gguf/$NAME".part*
split -b 48M -d -a 1 "$GGUF" ".device_cache/gguf/$NAME.part"  # .part0, .part1
(cd "$(dirname "$GGUF")" && sha256sum "$NAME") > ".device_cache/gguf/$NAME.sha256"
ls -l .whl .device_cache/gguf
du -sh .whl
cat <<MSG
Two device calls, the second at once after the first (a machine stays warm 30 s; ignored files
it holds are kept between calls):
  1. carry [".device_cache/gguf/$NAME.part0"], command: true
  2. carry [".whl", ".device_cache/gguf/$NAME.part1", ".device_cache/gguf/$NAME.sha256"],
     command: bash lab/scripts/device/smollm2_learn.sh \$OUT
MSG
