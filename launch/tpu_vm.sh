#!/usr/bin/env bash
# Launch knitjax training on a Cloud TPU VM slice (every worker runs the same command; the trainer
# is one multi-host JAX program, started with --distributed).
#
# Usage:
#   launch/tpu_vm.sh NAME ZONE ACCELERATOR_TYPE CONFIG WORKDIR [extra flags...]
#   e.g. launch/tpu_vm.sh kj-v5e europe-west4-b v5litepod-16 configs/arith_tiny.py gs://bucket/runs/a \
#          --config.mesh.shape='(1,-1,1)' --config.mesh.cpu_devices=0
#
# Needs: gcloud authenticated with a project that has TPU quota. WORKDIR should be a gs:// path
# (orbax and the metrics writer see the same directory from every host).
set -euo pipefail
if [[ $# -lt 5 ]]; then
  sed -n '2,11p' "$0"; exit 2
fi
NAME=$1 ZONE=$2 TYPE=$3 CONFIG=$4 WORKDIR=$5; shift 5
EXTRA=("$@")
VERSION=${TPU_SOFTWARE_VERSION:-v2-alpha-tpuv5-lite}
REPO_URL=${KNITJAX_REPO:-$(git config --get remote.origin.url || true)}
if [[ -z "$REPO_URL" ]]; then
  echo "error: set KNITJAX_REPO to a git URL the TPU VM can clone." >&2; exit 2
fi

if ! gcloud compute tpus tpu-vm describe "$NAME" --zone "$ZONE" >/dev/null 2>&1; then
  gcloud compute tpus tpu-vm create "$NAME" --zone "$ZONE" --accelerator-type "$TYPE" \
    --version "$VERSION"
fi

SETUP="set -e; [ -d knitjax ] || git clone $REPO_URL knitjax; cd knitjax && git pull -q; \
python3 -m venv .venv; . .venv/bin/activate; pip install -q -U pip; \
pip install -q 'jax[tpu]' -f https://storage.googleapis.com/jax-releases/libtpu_releases.html; \
pip install -q -e ."
gcloud compute tpus tpu-vm ssh "$NAME" --zone "$ZONE" --worker=all --command "$SETUP"

RUN="cd knitjax && . .venv/bin/activate && python -m knitjax.main --distributed \
--config $CONFIG --workdir $WORKDIR --config.mesh.cpu_devices=0 ${EXTRA[*]}"
gcloud compute tpus tpu-vm ssh "$NAME" --zone "$ZONE" --worker=all --command "$RUN"
