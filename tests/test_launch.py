"""``launch/tpu_vm.sh`` through its dry run: no Google Cloud here, and no gcloud ever runs.

The dry run prints each gcloud command as a shell line. The tests read those lines back the way a
shell would (``shlex.split``), then check, and where it is cheap execute under ``bash`` with stub
programs, the remote ``--command`` strings the workers would run.
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "launch", "tpu_vm.sh")
REPO_URL = "https://example.com/team/knit jax.git"  # a space: the URL must stay one word too
SPACED = "--config.train.tag=it's $HOME"  # a space, a quote and a `$` the workers must not expand
FLAGS = ["--config.mesh.shape=(1,-1,1)", SPACED]
UP = ["kj-v5e", "europe-west4-b", "v5litepod-16", "configs/arith_tiny.py", "gs://bucket/runs/a"]
SSH = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "kj-v5e", "--zone", "europe-west4-b"]
TRAINER_ARGV = [
  "-m",
  "knitjax.main",
  "--distributed",
  "--config",
  "configs/arith_tiny.py",
  "--workdir",
  "gs://bucket/runs/a",
  "--config.mesh.cpu_devices=0",
  *FLAGS,
]


def _executable(path, text):
  with open(path, "w") as f:
    f.write(textwrap.dedent(text).lstrip())
  os.chmod(path, 0o755)


def _launch(tmp_path, *args, dry_run=True, env=None):
  """Runs the script with a `gcloud` first on PATH that fails loudly and leaves a mark."""
  fake = tmp_path / "fake-gcloud"
  fake.mkdir(exist_ok=True)
  mark = tmp_path / "gcloud-ran"
  _executable(
    fake / "gcloud",
    f'#!/bin/sh\necho "gcloud ran: $*" >&2\ntouch {shlex.quote(str(mark))}\nexit 97\n',
  )
  full_env = {
    **os.environ,
    "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
    "KNITJAX_REPO": REPO_URL,
    **(env or {}),
  }
  argv = ["bash", SCRIPT, *(["--dry-run"] if dry_run else []), *args]
  result = subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=60)
  assert not mark.exists(), f"gcloud was executed: {result.stderr}"
  return result


def _commands(tmp_path, *args, env=None):
  result = _launch(tmp_path, *args, env=env)
  assert result.returncode == 0, result.stderr
  return [shlex.split(line) for line in result.stdout.splitlines()]


def _remote(argv):
  """The remote command of a printed `gcloud ... ssh` line, checked for bash syntax."""
  assert argv[: len(SSH)] == SSH and argv[-2] == "--command", argv
  command = argv[-1]
  syntax = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
  assert syntax.returncode == 0, syntax.stderr
  return command


def _statements(command):
  """The remote command as a shell splits it: words, grouped at each `;`."""
  lex = shlex.shlex(command, posix=True, punctuation_chars=";&|<>")
  lex.whitespace_split = True
  statements = [[]]
  for word in lex:
    if word == ";":
      statements.append([])
    else:
      statements[-1].append(word)
  return statements


def test_dry_run_prints_create_setup_run_on_every_worker(tmp_path):
  create, setup, run = _commands(tmp_path, "up", *UP, *FLAGS)
  describe = ["gcloud", "compute", "tpus", "tpu-vm", "describe", "kj-v5e", "--zone"]
  assert create == [
    *describe,
    "europe-west4-b",
    ">/dev/null",
    "2>&1",
    "||",
    *["gcloud", "compute", "tpus", "tpu-vm", "create", "kj-v5e", "--zone", "europe-west4-b"],
    *["--accelerator-type", "v5litepod-16", "--version", "v2-alpha-tpuv5-lite"],
  ]
  for argv in (setup, run):
    assert argv[len(SSH)] == "--worker=all"
  setup = _statements(_remote(setup))
  assert [f"repo={REPO_URL}"] in setup
  assert setup[-3:] == [
    [".", ".venv/bin/activate"],
    ["pip", "install", "-q", "jax[tpu]"],
    ["pip", "install", "-q", "-e", ".[gcs]"],
  ]
  # DRY_RUN=1 is the same switch as --dry-run.
  by_flag = _launch(tmp_path, "up", *UP, *FLAGS)
  by_env = _launch(tmp_path, "up", *UP, *FLAGS, dry_run=False, env={"DRY_RUN": "1"})
  assert by_env.returncode == 0 and by_env.stdout == by_flag.stdout


def test_run_command_keeps_each_flag_one_word(tmp_path):
  (run,) = _commands(tmp_path, "run", *UP[:2], *UP[3:], *FLAGS)
  (trainer,) = [words for words in _statements(_remote(run)) if words[:1] == ["nohup"]]
  assert trainer == [
    "nohup",
    "python",
    *TRAINER_ARGV,
    *[">>", "~/knitjax-run.log", "2", ">&", "1", "<", "/dev/null", "&", "echo", "$!"],
    *[">", "~/knitjax-run.pid"],
  ]
  assert "--config.mesh.shape=(1,-1,1)" in trainer  # the example of the usage text, exactly


def test_logs_stop_delete(tmp_path):
  (logs,) = _commands(tmp_path, "logs", "kj-v5e", "europe-west4-b")
  assert logs[len(SSH)] == "--worker=0"
  assert shlex.split(_remote(logs)) == ["tail", "-n", "100", "-F", "~/knitjax-run.log"]
  (logs_all,) = _commands(tmp_path, "logs", "kj-v5e", "europe-west4-b", "all")
  assert logs_all[len(SSH)] == "--worker=all"
  (stop,) = _commands(tmp_path, "stop", "kj-v5e", "europe-west4-b")
  assert stop[len(SSH)] == "--worker=all" and "kill" in _remote(stop)
  (delete,) = _commands(tmp_path, "delete", "kj-v5e", "europe-west4-b")
  assert delete == [*SSH[:4], "delete", "kj-v5e", "--zone", "europe-west4-b"]


@pytest.mark.parametrize(
  "args, message",
  [
    (["frob", "kj", "zone"], "unknown command 'frob'; choose one of: up, create, setup,"),
    (["logs", "kj", "zone", "w1"], "WORKER='w1' is not accepted"),
    (["run", "kj", "zone", "configs/arith_tiny.py"], "usage: launch/tpu_vm.sh [--dry-run] run"),
  ],
)
def test_bad_usage_names_the_value_before_any_gcloud(tmp_path, args, message):
  result = _launch(tmp_path, *args, dry_run=False)
  assert result.returncode == 2
  assert message in result.stderr


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
  except FileNotFoundError:
    return False


def _wait_for(predicate, seconds=20.0):
  deadline = time.monotonic() + seconds
  while not predicate():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.05)


def test_run_detaches_the_trainer_and_stop_ends_it(tmp_path):
  home, stubs = tmp_path / "home", tmp_path / "stubs"
  (home / "knitjax" / ".venv" / "bin").mkdir(parents=True)
  stubs.mkdir()
  (home / "knitjax" / ".venv" / "bin" / "activate").write_text(f'PATH="{stubs}:$PATH"\n')
  _executable(
    stubs / "python",
    f"""
    #!{sys.executable}
    import json, os, sys, time
    print("trainer up", flush=True)
    with open(os.path.expanduser("~/argv.json"), "w") as f:
      json.dump(sys.argv[1:], f)
    time.sleep(60)
    """,
  )
  (run,) = _commands(tmp_path, "run", *UP[:2], *UP[3:], *FLAGS)
  (setup,) = _commands(tmp_path, "setup", *UP[:2])
  (stop,) = _commands(tmp_path, "stop", *UP[:2])
  env = {**os.environ, "HOME": str(home)}

  def remote(argv):
    return subprocess.run(
      ["bash", "-c", _remote(argv)], env=env, cwd=home, capture_output=True, text=True, timeout=30
    )

  pid = None
  try:
    started = remote(run)  # returns at once: the trainer holds none of the ssh session's streams
    assert started.returncode == 0, started.stderr
    pid = int((home / "knitjax-run.pid").read_text())
    _wait_for(lambda: (home / "argv.json").exists() and (home / "argv.json").stat().st_size)
    assert json.loads((home / "argv.json").read_text()) == TRAINER_ARGV
    _wait_for(lambda: "trainer up" in (home / "knitjax-run.log").read_text())
    for again in (run, setup):  # neither starts a second trainer nor pulls code under this one
      refused = remote(again)
      assert refused.returncode == 1
      assert f"knitjax is running on {os.uname().nodename} (pid {pid})" in refused.stderr
    stopped = remote(stop)
    assert stopped.returncode == 0 and "stopped knitjax on" in stopped.stdout
    _wait_for(lambda: not _alive(pid))
    assert not (home / "knitjax-run.pid").exists()
    assert "knitjax is not running" in remote(stop).stdout
  finally:
    if pid is not None and _alive(pid):
      os.kill(pid, signal.SIGTERM)


# One stub for git, pip, uv and the python3.x candidates: it logs each call to ~/calls and acts
# out just enough. STUB_NEW names the pythons >= 3.11, STUB_VENV those whose venv module works
# (Debian-family images may ship python3.11 without it; the failure leaves a half-made venv).
_STUB = r"""
#!/bin/bash
name=${0##*/}
echo "$name $*" >> "$HOME/calls"
venv() { mkdir -p "$1/bin" && printf '#!/bin/sh\n' > "$1/bin/python" && chmod +x "$1/bin/python" \
  && : > "$1/bin/activate"; }
case $name in
  git) if [ "$1" = clone ]; then mkdir -p "$4/.git"; fi ;;
  uv) if [ "$1" = venv ]; then dir=${!#}; [ ! -e "$dir" ] || exit 3; venv "$dir"; fi ;;
  python3*)
    case "$1 $2" in
      "-c "*) case " $STUB_NEW " in *" $name "*) exit 0 ;; *) exit 1 ;; esac ;;
      "-m venv") case " $STUB_VENV " in *" $name "*) venv "$3" ;; *) venv "$3"; exit 1 ;; esac ;;
      "-m pip") mkdir -p "$HOME/.local/bin" && cp "$STUB" "$HOME/.local/bin/uv" ;;
    esac ;;
esac
"""


PROBE = "-c import sys; sys.exit(sys.version_info < (3, 11))"
PIP = ["pip install -q jax[tpu]", "pip install -q -e .[gcs]"]


@pytest.mark.parametrize(
  "new, venv, made_by",
  [
    (
      "python3.12 python3.11",
      "python3.12 python3.11",
      [f"python3.13 {PROBE}", f"python3.12 {PROBE}", "python3.12 -m venv .venv"],
    ),
    (  # python3.11 without a working venv module, python3 older: uv brings its own CPython
      "python3.11",
      "",
      [
        *(f"python3.{minor} {PROBE}" for minor in (13, 12, 11)),
        "python3.11 -m venv .venv",
        f"python3 {PROBE}",
        "python3 -m pip install -q --user uv",
        "uv python install 3.11",
        "uv venv -q --seed --python 3.11 .venv",  # the stub refuses a half-made .venv
      ],
    ),
  ],
)
def test_setup_makes_a_311_venv_once_and_repeats_harmlessly(tmp_path, new, venv, made_by):
  home, stubs, tools = tmp_path / "home", tmp_path / "stubs", tmp_path / "tools"
  for d in (home, stubs, tools):
    d.mkdir()
  _executable(stubs / "stub", _STUB)
  for name in ("git", "pip", "python3.13", "python3.12", "python3.11", "python3"):
    os.symlink(stubs / "stub", stubs / name)
  for tool in ("cat", "grep", "rm", "mkdir", "chmod", "cp"):  # nothing else from this machine
    os.symlink(shutil.which(tool), tools / tool)
  env = {
    "HOME": str(home),
    "PATH": f"{stubs}{os.pathsep}{tools}",
    "STUB": str(stubs / "stub"),
    "STUB_NEW": new,
    "STUB_VENV": venv,
  }
  (setup,) = _commands(tmp_path, "setup", *UP[:2])
  command = _remote(setup)

  def calls():
    result = subprocess.run(
      ["/bin/bash", "-c", command], env=env, cwd=home, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    lines = (home / "calls").read_text().splitlines()
    (home / "calls").unlink()
    return lines

  assert calls() == [f"git clone -q {REPO_URL} {home}/knitjax", *made_by, *PIP]
  assert os.access(home / "knitjax" / ".venv" / "bin" / "python", os.X_OK)
  assert calls() == [f"git -C {home}/knitjax pull -q --ff-only", *PIP]  # the venv is kept


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean(tmp_path):
  result = subprocess.run(["shellcheck", SCRIPT], capture_output=True, text=True)
  assert result.returncode == 0, result.stdout
  for argv in _commands(tmp_path, "up", *UP, *FLAGS)[1:]:  # what the workers run, too
    result = subprocess.run(
      ["shellcheck", "--shell=bash", "--exclude=SC1091", "-"],
      input=_remote(argv),
      capture_output=True,
      text=True,
    )
    assert result.returncode == 0, result.stdout


_README = os.path.join(REPO, "launch", "README.md")
_DOC_REPO = "https://github.com/your-org/knitjax.git"


def _doc_blocks(tmp_path):
  """The two code blocks of launch/README.md's "Dry run of the example", as the script prints."""
  env = {"KNITJAX_REPO": _DOC_REPO}
  up = _launch(tmp_path, "up", *UP, "--config.mesh.shape=(1,-1,1)", env=env)
  assert up.returncode == 0, up.stderr
  others = []
  for command in ("logs", "stop", "delete"):
    result = _launch(tmp_path, command, "kj-v5e", "europe-west4-b", env=env)
    assert result.returncode == 0, result.stderr
    others.append(f"$ launch/tpu_vm.sh --dry-run {command} kj-v5e europe-west4-b\n{result.stdout}")
  return up.stdout, "".join(others)


def test_readme_shows_what_the_dry_run_prints(tmp_path):
  """launch/README.md's dry-run blocks are this script's output, byte for byte.

  ``KNITJAX_UPDATE_DOCS=1 pytest tests/test_launch.py -k readme`` rewrites them from the script.
  """
  with open(_README) as f:
    text = f.read()
  head, rest = text.split("## Dry run of the example\n", 1)
  section, tail = rest.split("\n## ", 1)
  intro, block1, middle, block2, outro = section.split("```")
  want1, want2 = _doc_blocks(tmp_path)
  if os.environ.get("KNITJAX_UPDATE_DOCS") == "1":
    new = "```".join([intro, "\n" + want1, middle, "\n" + want2, outro])
    with open(_README, "w") as f:
      f.write(head + "## Dry run of the example\n" + new + "\n## " + tail)
    return
  assert block1 == "\n" + want1, "launch/README.md: the `up` dry run differs from the script's"
  assert block2 == "\n" + want2, "launch/README.md: the logs/stop/delete dry runs differ"


def test_rollout_starts_a_rollout_host_on_every_worker(tmp_path):
  (run,) = _commands(tmp_path, "rollout", *UP[:2], *UP[3:], *FLAGS)
  assert run[len(SSH)] == "--worker=all"
  (host,) = [words for words in _statements(_remote(run)) if words[:1] == ["nohup"]]
  argv = [w for w in TRAINER_ARGV if w != "--distributed"]
  assert host[:4] == ["nohup", "python", "-m", "knitjax.main"]
  assert host[4:5] == ["--role=rollout"] and host[5 : 5 + len(argv) - 2] == argv[2:]
  assert "--distributed" not in host
