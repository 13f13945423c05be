#!/usr/bin/env bash
# Launch knitjax training on a Cloud TPU VM slice. Every worker runs the same command: the trainer
# is one multi-host JAX program, started with --distributed. A disaggregated trainer of any
# number of processes takes its rollout from Ray rollout workers on other VMs
# (--config.topology.rollout_workers=N): `ray-head` starts a Ray cluster on the trainer VM,
# `ray-workers` joins every worker of a rollout VM to it (one rollout actor each), and `run` is
# given --config.topology.ray_address=HEAD_IP:6379.
#
# Usage: launch/tpu_vm.sh [--dry-run] COMMAND NAME ZONE [ARGS...]
#   up     NAME ZONE TYPE CONFIG WORKDIR [FLAGS...]   create (if missing), setup, run
#   create NAME ZONE TYPE                  create the TPU VM unless it exists
#   setup  NAME ZONE                       clone or pull knitjax, make a Python >= 3.11 venv if
#                                          missing, pip install (safe to repeat)
#   run    NAME ZONE CONFIG WORKDIR [FLAGS...]   start the trainer on every worker, detached
#                                          (nohup), logging to ~/knitjax-run.log on each
#   ray-head NAME ZONE                     start a Ray head on worker 0 (no actors there: the
#                                          trainer holds its TPU), join the other workers to it,
#                                          print the address HEAD_IP:6379
#   ray-workers NAME ZONE HEAD_IP:PORT     join every worker of rollout VM NAME to that Ray
#                                          head, one rollout actor per worker
#   ray-stop NAME ZONE                     `ray stop` on every worker
#   logs   NAME ZONE [WORKER]              follow a worker's log (default 0; "all": every worker)
#   stop   NAME ZONE                       stop the trainer on every worker (the VM stays up)
#   delete NAME ZONE                       delete the TPU VM (gcloud asks to confirm)
# e.g.
#   launch/tpu_vm.sh up kj-v5e europe-west4-b v5litepod-16 configs/arith_tiny.py \
#     gs://bucket/runs/a --config.mesh.shape='(1,-1,1)'
#
# --dry-run (or DRY_RUN=1) prints each gcloud command, one per line, ready to paste; runs none.
# Environment: TPU_SOFTWARE_VERSION (default v2-alpha-tpuv5-lite), KNITJAX_REPO (a git URL the
# workers can clone; default: this checkout's origin), KNITJAX_RAY_TOKEN_FILE (the Ray cluster's
# token, made by ray-head if missing, mode 0600; default ~/.config/knitjax/ray_auth_token).
# Needs: gcloud authenticated with a project that has TPU quota. WORKDIR should be a gs:// path
# (orbax and the metrics writer see the same directory from every host).

# The remote snippets below are single-quoted on purpose: they expand on the workers.
# shellcheck disable=SC2016

set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
COMMANDS="up, create, setup, run, ray-head, ray-workers, ray-stop, logs, stop, delete"
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

# A worker that holds a Ray token (ray-head, ray-workers) talks to Ray with it: an explicit
# ray_address (host:port) does not turn Ray's token authentication on by itself.
RAY_TOKEN_MODE='if [ -s ~/.ray/auth_token ]; then export RAY_AUTH_MODE=token; fi'

run_command() {  # $1: config, $2: workdir, then flags
  local args
  args=$(printf '%q ' --distributed --config "$1" --workdir "$2" --config.mesh.cpu_devices=0 "${@:3}")
  join "set -e" "$LIVE" "$BUSY" 'cd ~/knitjax' '. .venv/bin/activate' "$RAY_TOKEN_MODE" \
    "nohup python -m knitjax.main $args>> ~/knitjax-run.log 2>&1 < /dev/null & echo \$! > ~/knitjax-run.pid" \
    'echo "knitjax started on $(hostname) (pid $!), log ~/knitjax-run.log"'
}

# The Ray cluster. The token is one file on this machine (made once, owner-only), copied by scp
# to ~/$STAGED on each worker and moved from there to ~/.ray/auth_token (0600, in a 0700
# folder) by the worker's ray command, whose EXIT trap removes what is left; it never appears on
# a command line. Ray runs from knitjax's venv in ~/knitjax (the rollout actors import knitjax).
RAY_PORT=6379
TOKEN_FILE=${KNITJAX_RAY_TOKEN_FILE:-${XDG_CONFIG_HOME:-$HOME/.config}/knitjax/ray_auth_token}
STAGED=.knitjax-ray-token
TOKEN_MAKE=(python3 -c 'import secrets; print(secrets.token_hex(32), end="")')

# $1: --head (then $2: the head's IP) or --join (then $2: the head's IP:PORT, $3: CPUs the node
# offers Ray). Each rollout actor takes one CPU: one actor per worker, as each owns its worker's
# TPU chips. The head takes none: the trainer holds its TPU. A joining worker that is itself the
# head is left alone.
ray_command() {
  local ip start steps=("set -e" "trap 'rm -f ~/$STAGED' EXIT")
  ip=$(printf '%q' "${2%:*}")
  if [[ $1 == --head ]]; then
    # As knitjax.distributed.local_ray does: no dashboard, no unauthenticated metrics server.
    start="AUTOSCALER_METRIC_PORT=-1 ray start --head --port=$RAY_PORT --node-ip-address=$ip"
    start+=" --num-cpus=0 --include-dashboard=false --disable-usage-stats"
    start+=" --system-config='{\"enable_metrics_collection\": false}'"
  else
    steps+=("case \" \$(hostname -I) \" in *\" $ip \"*) echo \"\$(hostname) is the Ray head\"; exit 0 ;; esac")
    start="ray start --address=$(printf '%q' "$2") --num-cpus=$3 --disable-usage-stats"
  fi
  join "${steps[@]}" "$LIVE" "$BUSY" \
    'mkdir -p ~/.ray' 'chmod 700 ~/.ray' "chmod 600 ~/$STAGED" "mv -f ~/$STAGED ~/.ray/auth_token" \
    'cd ~/knitjax' '. .venv/bin/activate' 'pip install -q -e ".[ray]"' \
    'export RAY_AUTH_MODE=token' "$start"
}
RAY_STOP_COMMAND='if [ -x ~/knitjax/.venv/bin/ray ]; then ~/knitjax/.venv/bin/ray stop; else echo "no Ray on $(hostname)"; fi'

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

# The token file, made owner-only if missing (in a dry run: the line that would make it).
make_token() {
  if [[ -s $TOKEN_FILE ]]; then
    if [[ $DRY_RUN != 1 ]]; then chmod 600 "$TOKEN_FILE"; fi
    return
  fi
  local dir
  dir=$(dirname "$TOKEN_FILE")
  if [[ $DRY_RUN == 1 ]]; then
    printf '(umask 077 && mkdir -p %s && %s > %s)\n' "$(shell_word "$dir")" "$(show "${TOKEN_MAKE[@]}")" \
      "$(shell_word "$TOKEN_FILE")"
  else
    (umask 077 && mkdir -p "$dir" && "${TOKEN_MAKE[@]}" > "$TOKEN_FILE.new" && mv -f "$TOKEN_FILE.new" "$TOKEN_FILE")
  fi
}

push_token() {  # to ~/$STAGED on every worker of $NAME
  gcloud_ compute tpus tpu-vm scp "$TOKEN_FILE" "$NAME:$STAGED" --zone "$ZONE" --worker=all
}

# The head's internal IP (worker 0's, as gcloud ssh --worker=0 reaches it) into $HEAD_IP. A dry
# run prints `HEAD_IP=$(gcloud ... describe ...)` and leaves $HEAD_IP in the lines after it.
HEAD_MARK=__HEAD_IP__
head_ip() {
  local describe=(compute tpus tpu-vm describe "$NAME" --zone "$ZONE"
    '--format=value(networkEndpoints[0].ipAddress)')
  if [[ $DRY_RUN == 1 ]]; then
    printf 'HEAD_IP=$(%s)\n' "$(show gcloud "${describe[@]}")"
    HEAD_IP=$HEAD_MARK
    return
  fi
  HEAD_IP=$(gcloud "${describe[@]}")
  local ipv4='^[0-9]+[.][0-9]+[.][0-9]+[.][0-9]+$'
  if [[ ! $HEAD_IP =~ $ipv4 ]]; then
    echo "error: gcloud gave '$HEAD_IP' as worker 0's internal IP of $NAME; expected an IPv4 address." >&2
    exit 1
  fi
}

on_head_workers() {  # on_workers, with $HEAD_IP as a dry run prints it: "$HEAD_IP" for the mark
  if [[ $DRY_RUN == 1 ]]; then
    local line quoted="'\"\$HEAD_IP\"'"  # leaves the single-quoted --command for "$HEAD_IP"
    line=$(on_workers "$1" "$2")
    printf '%s\n' "${line//$HEAD_MARK/$quoted}"
  else
    on_workers "$1" "$2"
  fi
}

ray_next() {  # $1: the head's IP
  printf 'ray_address: %s (ray-workers ROLLOUT_VM ZONE %s, then run with --config.topology.ray_address=%s)' \
    "$1:$RAY_PORT" "$1:$RAY_PORT" "$1:$RAY_PORT"
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
    on_workers all "$(run_command "$@")"
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
    on_workers all "$(run_command "$@")"
    ;;
  ray-head)
    need 2 "ray-head NAME ZONE" "$@"
    NAME=$1 ZONE=$2
    head_ip
    make_token
    push_token
    on_head_workers 0 "$(ray_command --head "$HEAD_IP")"
    on_head_workers all "$(ray_command --join "$HEAD_IP:$RAY_PORT" 0)"
    if [[ $DRY_RUN == 1 ]]; then
      printf 'echo "%s"\n' "$(ray_next '$HEAD_IP')"
    else
      ray_next "$HEAD_IP"
      echo
    fi
    ;;
  ray-workers)
    need 3 "ray-workers NAME ZONE HEAD_IP:PORT" "$@"
    NAME=$1 ZONE=$2 HEAD=$3
    address='^[0-9]+[.][0-9]+[.][0-9]+[.][0-9]+:[0-9]+$'
    if [[ ! $HEAD =~ $address ]]; then
      echo "error: HEAD_IP:PORT='$HEAD' is not accepted; give what ray-head printed, e.g. 10.164.0.5:$RAY_PORT." >&2
      exit 2
    fi
    if [[ ! -s $TOKEN_FILE ]]; then
      echo "error: no Ray token at $TOKEN_FILE; run ray-head first (it makes one), or set KNITJAX_RAY_TOKEN_FILE to the head's." >&2
      exit 2
    fi
    make_token
    push_token
    on_workers all "$(ray_command --join "$HEAD" 1)"
    ;;
  ray-stop)
    need 2 "ray-stop NAME ZONE" "$@"
    NAME=$1 ZONE=$2
    on_workers all "$RAY_STOP_COMMAND"
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
