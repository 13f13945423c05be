#!/usr/bin/env bash
# Launch knitjax training on a Cloud TPU VM slice. Every worker runs the same command: the trainer
# is one multi-host JAX program, started with --distributed. A disaggregated trainer with
# --config.runtime.rollout_hosts=N (on a single-host VM) takes its rollout from N rollout hosts:
# `rollout` starts one on every worker of another TPU VM.
#
# Usage: launch/tpu_vm.sh [--dry-run] COMMAND NAME ZONE [ARGS...]
#   up     NAME ZONE TYPE CONFIG WORKDIR [FLAGS...]   create (if missing), setup, run
#   create NAME ZONE TYPE                  create the TPU VM unless it exists
#   setup  NAME ZONE                       clone or pull knitjax, make a Python >= 3.11 venv if
#                                          missing, pip install (safe to repeat)
#   run    NAME ZONE CONFIG WORKDIR [FLAGS...]   start the trainer on every worker, detached
#                                          (nohup), logging to ~/knitjax-run.log on each
#   rollout NAME ZONE CONFIG WORKDIR [FLAGS...]  start a rollout host (--role=rollout) on every
#                                          worker, detached, same log; give the trainer's config,
#                                          workdir and flags (rollout_listen: its internal IP)
#   logs   NAME ZONE [WORKER]              follow a worker's log (default 0; "all": every worker)
#   stop   NAME ZONE                       stop the trainer on every worker (the VM stays up)
#   delete NAME ZONE                       delete the TPU VM (gcloud asks to confirm)
# e.g.
#   launch/tpu_vm.sh up kj-v5e europe-west4-b v5litepod-16 configs/arith_tiny.py \
#     gs://bucket/runs/a --config.mesh.shape='(1,-1,1)'
#
# --dry-run (or DRY_RUN=1) prints each gcloud command, one per line, ready to paste; runs none.
# Environment: TPU_SOFTWARE_VERSION (default v2-alpha-tpuv5-lite), KNITJAX_REPO (a git URL the
# workers can clone; default: this checkout's origin).
# Needs: gcloud authenticated with a project that has TPU quota. WORKDIR should be a gs:// path
# (orbax and the metrics writer see the same directory from every host).

# The remote snippets below are single-quoted on purpose: they expand on the workers.
# shellcheck disable=SC2016

set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
COMMANDS="up, create, setup, run, rollout, logs, stop, delete"
VERSION=${TPU_SOFTWARE_VERSION:-v2-alpha-tpuv5-lite}
DRY_RUN=${DRY_RUN:-0}
if [[ ${1:-} == --dry-run ]]; then
  DRY_RUN=1
  shift
fi

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
}

# A remote command is one line of shell. Values from the caller reach it only through
# `printf %q`, so the workers' shell sees each of them as exactly one word.
join() {
  local out=$1 step
  shift
  for step in "$@"; do out+="; $step"; done
  printf '%s' "$out"
}

# `live` is true, and sets $pid, while the trainer started by `run` is alive on this worker; the
# cmdline check keeps a stale pid file from naming an unrelated process.
LIVE='live() { pid=$(cat ~/knitjax-run.pid 2>/dev/null) && grep -aqs knitjax.main "/proc/$pid/cmdline"; }'
BUSY='if live; then echo "knitjax is running on $(hostname) (pid $pid); stop it first." >&2; exit 1; fi'

setup_command() {  # $1: the git URL to clone
  join "set -e" "$LIVE" "$BUSY" \
    'export PATH="$HOME/.local/bin:$PATH"' \
    "repo=$(printf '%q' "$1")" \
    'if [ -d ~/knitjax/.git ]; then git -C ~/knitjax pull -q --ff-only; else git clone -q "$repo" ~/knitjax; fi' \
    'cd ~/knitjax' \
    'if [ ! -x .venv/bin/python ]; then rm -rf .venv; for py in python3.13 python3.12 python3.11 python3; do command -v "$py" >/dev/null && "$py" -c "import sys; sys.exit(sys.version_info < (3, 11))" && "$py" -m venv .venv 2>/dev/null && break; rm -rf .venv; done; fi' \
    'if [ ! -x .venv/bin/python ]; then command -v uv >/dev/null || python3 -m pip install -q --user uv; uv python install 3.11; uv venv -q --seed --python 3.11 .venv; fi' \
    '. .venv/bin/activate' \
    'pip install -q "jax[tpu]"' \
    'pip install -q -e ".[gcs]"'
}

run_command() {  # $1: --distributed (trainer) or --role=rollout, $2: config, $3: workdir, flags
  local args
  args=$(printf '%q ' "$1" --config "$2" --workdir "$3" --config.mesh.cpu_devices=0 "${@:4}")
  join "set -e" "$LIVE" "$BUSY" 'cd ~/knitjax' '. .venv/bin/activate' \
    "nohup python -m knitjax.main $args>> ~/knitjax-run.log 2>&1 < /dev/null & echo \$! > ~/knitjax-run.pid" \
    'echo "knitjax started on $(hostname) (pid $!), log ~/knitjax-run.log"'
}

STOP_COMMAND=$(join "$LIVE" \
  'if live; then kill "$pid"; echo "stopped knitjax on $(hostname) (pid $pid)"; else echo "knitjax is not running on $(hostname)"; fi' \
  'rm -f ~/knitjax-run.pid')
LOGS_COMMAND='tail -n 100 -F ~/knitjax-run.log'

# Dry-run output: each word as a POSIX shell reads it back, quoted only where needed.
shell_word() {
  local w=$1 q="'" out="'" plain='^[A-Za-z0-9_./:=,@%+-]+$'
  if [[ $w =~ $plain ]]; then
    printf '%s' "$w"
    return
  fi
  while [[ $w == *"$q"* ]]; do
    out+="${w%%"$q"*}'\\''"
    w=${w#*"$q"}
  done
  printf '%s' "$out$w'"
}

show() {
  local line="" w
  for w in "$@"; do line+="${line:+ }$(shell_word "$w")"; done
  printf '%s\n' "$line"
}

gcloud_() {
  if [[ $DRY_RUN == 1 ]]; then show gcloud "$@"; else gcloud "$@"; fi
}

on_workers() {  # $1: "all" or a worker index, $2: the remote command
  gcloud_ compute tpus tpu-vm ssh "$NAME" --zone "$ZONE" --worker="$1" --command "$2"
}

create() {
  local describe=(compute tpus tpu-vm describe "$NAME" --zone "$ZONE")
  local make=(compute tpus tpu-vm create "$NAME" --zone "$ZONE" --accelerator-type "$TYPE"
    --version "$VERSION")
  if [[ $DRY_RUN == 1 ]]; then
    printf '%s >/dev/null 2>&1 || %s\n' "$(show gcloud "${describe[@]}")" \
      "$(show gcloud "${make[@]}")"
  elif gcloud "${describe[@]}" >/dev/null 2>&1; then
    echo "TPU VM $NAME already exists in $ZONE."
  else
    gcloud "${make[@]}"
  fi
}

setup() {
  local url=${KNITJAX_REPO:-}
  if [[ -z $url ]]; then url=$(git -C "$HERE" config --get remote.origin.url || true); fi
  if [[ -z $url ]]; then
    echo "error: KNITJAX_REPO is unset and this checkout has no origin; set it to a git URL the TPU VM can clone." >&2
    exit 2
  fi
  on_workers all "$(setup_command "$url")"
}

need() {  # $1: how many arguments the command needs, $2: its usage, then the arguments
  local n=$1 line=$2
  shift 2
  if (($# < n)); then
    echo "usage: launch/tpu_vm.sh [--dry-run] $line" >&2
    exit 2
  fi
}

if [[ $# -lt 1 ]]; then
  usage >&2
  exit 2
fi
CMD=$1
shift
case $CMD in
  up)
    need 5 "up NAME ZONE TYPE CONFIG WORKDIR [FLAGS...]" "$@"
    NAME=$1 ZONE=$2 TYPE=$3
    shift 3
    create
    setup
    on_workers all "$(run_command --distributed "$@")"
    ;;
  create)
    need 3 "create NAME ZONE TYPE" "$@"
    NAME=$1 ZONE=$2 TYPE=$3
    create
    ;;
  setup)
    need 2 "setup NAME ZONE" "$@"
    NAME=$1 ZONE=$2
    setup
    ;;
  run)
    need 4 "run NAME ZONE CONFIG WORKDIR [FLAGS...]" "$@"
    NAME=$1 ZONE=$2
    shift 2
    on_workers all "$(run_command --distributed "$@")"
    ;;
  rollout)
    need 4 "rollout NAME ZONE CONFIG WORKDIR [FLAGS...]" "$@"
    NAME=$1 ZONE=$2
    shift 2
    on_workers all "$(run_command --role=rollout "$@")"
    ;;
  logs)
    need 2 "logs NAME ZONE [WORKER]" "$@"
    NAME=$1 ZONE=$2 WORKER=${3:-0}
    index='^[0-9]+$'
    if [[ $WORKER != all && ! $WORKER =~ $index ]]; then
      echo "error: WORKER='$WORKER' is not accepted; give a worker index (0, 1, ...) or all." >&2
      exit 2
    fi
    on_workers "$WORKER" "$LOGS_COMMAND"
    ;;
  stop)
    need 2 "stop NAME ZONE" "$@"
    NAME=$1 ZONE=$2
    on_workers all "$STOP_COMMAND"
    ;;
  delete)
    need 2 "delete NAME ZONE" "$@"
    NAME=$1 ZONE=$2
    gcloud_ compute tpus tpu-vm delete "$NAME" --zone "$ZONE"
    ;;
  -h | --help | help) usage ;;
  *)
    echo "error: unknown command '$CMD'; choose one of: $COMMANDS." >&2
    exit 2
    ;;
esac
