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
    (["ray-head", "kj"], "usage: launch/tpu_vm.sh [--dry-run] ray-head NAME ZONE"),
    (["ray-workers", "kj", "zone"], "usage: launch/tpu_vm.sh [--dry-run] ray-workers NAME ZONE"),
    (["ray-workers", "kj", "zone", "10.164.0.5"], "HEAD_IP:PORT='10.164.0.5' is not accepted"),
    (["ray-workers", "kj", "zone", "$(id):6379"], "HEAD_IP:PORT='$(id):6379' is not accepted"),
    (["ray-stop", "kj"], "usage: launch/tpu_vm.sh [--dry-run] ray-stop NAME ZONE"),
  ],
)
def test_bad_usage_names_the_value_before_any_gcloud(tmp_path, args, message):
  result = _launch(tmp_path, *args, dry_run=False)
  assert result.returncode == 2
  assert message in result.stderr
  assert len(result.stderr.splitlines()) == 1, result.stderr


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
  remotes = [_remote(argv) for argv in _commands(tmp_path, "up", *UP, *FLAGS)[1:]]
  env = _ray_env(tmp_path)
  for args in (["ray-head", *UP[:2]], ["ray-workers", *UP[:2], HEAD], ["ray-stop", *UP[:2]]):
    remotes += [_remote(argv) for argv in _ssh_lines(_commands(tmp_path, *args, env=env))]
  for remote in remotes:  # what the workers run, too ($HEAD_IP: the IP a dry run leaves to you)
    result = subprocess.run(
      ["shellcheck", "--shell=bash", "--exclude=SC1091", "-"],
      input=remote.replace("$HEAD_IP", "10.164.0.5"),
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


# The Ray cluster: `ray-head` on the trainer VM, `ray-workers` on each rollout VM, `ray-stop`.
HEAD = "10.164.0.5:6379"
TOKEN = "5eb0a7c1d2e3f40516273849a0b1c2d3e4f5061728394a5b6c7d8e9f00112233"
STAGED = ".knitjax-ray-token"


def _ray_env(tmp_path, token=TOKEN):
  """KNITJAX_RAY_TOKEN_FILE in tmp_path, holding `token` (None: no file yet)."""
  path = tmp_path / "secrets" / "ray_auth_token"
  if token is not None:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_text(token)
    path.chmod(0o600)
  return {"KNITJAX_RAY_TOKEN_FILE": str(path)}


def _ssh_lines(commands):
  return [argv for argv in commands if argv[:5] == SSH[:5]]


def _worker(argv):
  assert argv[: len(SSH)] == SSH, argv
  return argv[len(SSH)]


def _starts(remote):
  """The `ray start` statements of a remote command (env assignments before `ray` dropped)."""
  starts = []
  for words in _statements(remote):
    while words and "=" in words[0] and not words[0].startswith("-"):
      words = words[1:]
    if words[:2] == ["ray", "start"]:
      starts.append(words)
  return starts


def test_ray_head_starts_the_head_on_worker_0_only_and_joins_the_others(tmp_path):
  env = _ray_env(tmp_path, token=None)
  result = _launch(tmp_path, "ray-head", *UP[:2], env=env)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  # The head's IP is worker 0's internal address, read from gcloud (a dry run leaves $HEAD_IP).
  assert lines[0].startswith("HEAD_IP=$(") and lines[0].endswith(")")
  assert shlex.split(lines[0][len("HEAD_IP=$(") : -1]) == [
    *SSH[:4],
    "describe",
    "kj-v5e",
    "--zone",
    "europe-west4-b",
    "--format=value(networkEndpoints[0].ipAddress)",
  ]
  # No token yet: the line that would make one, owner-only; the dry run itself makes none.
  token_file = env["KNITJAX_RAY_TOKEN_FILE"]
  assert lines[1].startswith("(umask 077 && mkdir -p ") and lines[1].endswith(f"> {token_file})")
  assert not os.path.exists(token_file)
  scp, head, join, echo = (shlex.split(line) for line in lines[2:])
  assert scp == [*SSH[:4], "scp", token_file, f"kj-v5e:{STAGED}", *SSH[6:], "--worker=all"]
  assert _worker(head) == "--worker=0" and _worker(join) == "--worker=all"
  (start,) = _starts(_remote(head))
  assert start[:3] == ["ray", "start", "--head"]
  assert {"--port=6379", "--node-ip-address=$HEAD_IP", "--num-cpus=0"} <= set(start)
  assert "--include-dashboard=false" in start
  # The other workers join it and offer no CPU (their TPU is the trainer's); not as a head.
  (joined,) = _starts(_remote(join))
  assert joined == [
    *["ray", "start", "--address=$HEAD_IP:6379", "--num-cpus=0", "--disable-usage-stats"],
  ]
  assert "--head" not in _remote(join)
  assert echo[0] == "echo" and "--config.topology.ray_address=$HEAD_IP:6379" in echo[1]
  # With a token already there, the same lines less the one that makes it.
  result = _launch(tmp_path, "ray-head", *UP[:2], env=_ray_env(tmp_path))
  assert result.stdout.splitlines() == [lines[0], *lines[2:]]


def test_ray_workers_join_every_worker_to_the_head(tmp_path):
  env = _ray_env(tmp_path)
  scp, join = _commands(tmp_path, "ray-workers", *UP[:2], HEAD, env=env)
  token_file = env["KNITJAX_RAY_TOKEN_FILE"]
  assert scp == [*SSH[:4], "scp", token_file, f"kj-v5e:{STAGED}", *SSH[6:], "--worker=all"]
  assert _worker(join) == "--worker=all"
  remote = _remote(join)
  assert _starts(remote) == [
    ["ray", "start", f"--address={HEAD}", "--num-cpus=1", "--disable-usage-stats"]
  ]
  assert "--head" not in remote
  statements = [" ".join(words) for words in _statements(remote)]
  assert statements[-2] == "export RAY_AUTH_MODE=token"  # what `ray start` runs with
  assert statements[-1].startswith("ray start ")


def test_ray_workers_needs_the_token_before_any_gcloud(tmp_path):
  env = _ray_env(tmp_path, token=None)
  result = _launch(
    tmp_path, "ray-workers", "kj-v5e", "europe-west4-b", HEAD, dry_run=False, env=env
  )
  assert result.returncode == 2 and result.stdout == ""
  assert result.stderr == (
    f"error: no Ray token at {env['KNITJAX_RAY_TOKEN_FILE']}; run ray-head first (it makes one), "
    "or set KNITJAX_RAY_TOKEN_FILE to the head's.\n"
  )


def test_the_ray_token_is_never_on_a_command_line(tmp_path):
  """A real (not dry) ray-head then ray-workers against a gcloud that records its argv and plays
  scp: the token is made once, owner-only, and reaches the workers only as a file's content."""
  fake, log, remote = tmp_path / "gcloud-bin", tmp_path / "gcloud.log", tmp_path / "remote"
  fake.mkdir()
  remote.mkdir()
  _executable(
    fake / "gcloud",
    f"""
    #!{sys.executable}
    import json, shutil, sys
    with open({str(log)!r}, "a") as f:
      f.write(json.dumps(sys.argv[1:]) + "\\n")
    if "describe" in sys.argv:
      print("10.164.0.5")
    if "scp" in sys.argv:
      source = sys.argv[sys.argv.index("scp") + 1]
      shutil.copy(source, {str(remote)!r} + "/" + sys.argv[1 + sys.argv.index("scp") + 1])
    """,
  )
  env = {
    **os.environ,
    **_ray_env(tmp_path, token=None),
    "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
  }
  token_file = tmp_path / "secrets" / "ray_auth_token"

  def launch(*args):
    result = subprocess.run(
      ["bash", SCRIPT, *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr

  out = launch("ray-head", "kj-train", "europe-west4-b")
  assert f"ray_address: {HEAD} " in out and f"--config.topology.ray_address={HEAD}" in out
  token = token_file.read_text()
  assert len(token) == 64 and int(token, 16) >= 0  # 256 random bits, hex
  assert token_file.stat().st_mode & 0o777 == 0o600
  assert token_file.parent.stat().st_mode & 0o777 == 0o700
  out += launch("ray-workers", "kj-roll", "europe-west4-b", HEAD)
  out += launch("--dry-run", "ray-head", "kj-train", "europe-west4-b")
  out += launch("--dry-run", "ray-workers", "kj-roll", "europe-west4-b", HEAD)
  assert token_file.read_text() == token  # made once: every VM gets the same
  calls = [json.loads(line) for line in log.read_text().splitlines()]
  assert [c[3] for c in calls] == ["describe", "scp", "ssh", "ssh", "scp", "ssh"]
  assert (remote / f"kj-train:{STAGED}").read_text() == token
  assert (remote / f"kj-roll:{STAGED}").read_text() == token
  assert token not in out and not any(token in word for c in calls for word in c)


def _ray_stubs(tmp_path, host_ip):
  """A worker's home with knitjax's venv whose `ray` and `pip` log their calls, and a hostname
  that answers `host_ip` to -I; the token staged by scp, mode 0644 to see it tightened."""
  home, stubs = tmp_path / "home", tmp_path / "stubs"
  (home / "knitjax" / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
  stubs.mkdir(exist_ok=True)
  (home / "knitjax" / ".venv" / "bin" / "activate").write_text(f'PATH="{stubs}:$PATH"\n')
  log = 'echo "${0##*/} $* RAY_AUTH_MODE=${RAY_AUTH_MODE:-} cwd=$PWD" >> "$HOME/calls"'
  for name in ("ray", "pip"):
    _executable(stubs / name, f"#!/bin/bash\n{log}\n")
  _executable(
    stubs / "hostname",
    f'#!/bin/sh\nif [ "$1" = -I ]; then echo "{host_ip} 10.200.0.1 "; else echo worker; fi\n',
  )
  (home / STAGED).write_text(TOKEN)
  (home / STAGED).chmod(0o644)
  env = {**os.environ, "HOME": str(home), "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}"}
  env.pop("RAY_AUTH_MODE", None)  # a worker's login shell has none (Ray sets it in its drivers)
  return home, env


def _run_remote(remote, home, env):
  return subprocess.run(
    ["bash", "-c", remote], env=env, cwd=home, capture_output=True, text=True, timeout=30
  )


def test_the_ray_commands_install_the_token_and_start_ray_with_it(tmp_path):
  env = _ray_env(tmp_path)
  head, join = _ssh_lines(_commands(tmp_path, "ray-head", *UP[:2], env=env))
  _, rollout = _commands(tmp_path, "ray-workers", *UP[:2], HEAD, env=env)
  ip = HEAD.split(":")[0]

  def on(host_ip, argv, label):
    home, worker_env = _ray_stubs(tmp_path / label, host_ip)
    result = _run_remote(_remote(argv).replace("$HEAD_IP", ip), home, worker_env)
    assert result.returncode == 0, result.stderr
    calls = (home / "calls").read_text().splitlines() if (home / "calls").exists() else []
    return home, result, calls

  # Worker 0: the token moved into ~/.ray (0600 in a 0700 folder), Ray installed, the head up.
  home, _, calls = on(ip, head, "head")
  token = home / ".ray" / "auth_token"
  assert token.read_text() == TOKEN and token.stat().st_mode & 0o777 == 0o600
  assert token.parent.stat().st_mode & 0o777 == 0o700 and not (home / STAGED).exists()
  cwd = f"cwd={home}/knitjax"
  assert calls[0] == f"pip install -q -e .[ray] RAY_AUTH_MODE= {cwd}"
  assert calls[1].startswith("ray start --head --port=6379 --node-ip-address=10.164.0.5 ")
  assert calls[1].endswith(f" RAY_AUTH_MODE=token {cwd}") and len(calls) == 2
  # The join step leaves the head's host alone (and the staged token gone).
  home, result, calls = on(ip, join, "head-again")
  assert calls == [] and "is the Ray head" in result.stdout and not (home / STAGED).exists()
  # Another trainer worker joins with no CPU; a rollout worker with one (one actor each).
  for argv, cpus, label in ((join, 0, "trainer-1"), (rollout, 1, "rollout-0")):
    home, _, calls = on("10.164.0.9", argv, label)
    assert (home / ".ray" / "auth_token").read_text() == TOKEN
    assert calls[1] == (
      f"ray start --address={HEAD} --num-cpus={cpus} --disable-usage-stats RAY_AUTH_MODE=token "
      f"cwd={home}/knitjax"  # where Ray's workers start, so that knitjax's relative paths hold
    )


def test_run_passes_the_ray_flags_and_the_token_mode_to_the_trainer(tmp_path):
  flags = [
    "--config.topology.mode=disaggregated",
    f"--config.topology.ray_address={HEAD}",
    "--config.topology.rollout_workers=4",
  ]
  (run,) = _commands(tmp_path, "run", *UP[:2], *UP[3:], *flags)
  assert _worker(run) == "--worker=all"
  (trainer,) = [words for words in _statements(_remote(run)) if words[:1] == ["nohup"]]
  argv = [*TRAINER_ARGV[: len(TRAINER_ARGV) - len(FLAGS)], *flags]
  assert trainer[:2] == ["nohup", "python"] and trainer[2 : 2 + len(argv)] == argv
  # The trainer talks to Ray with the token where ray-head/ray-workers installed one.
  home, stubs = tmp_path / "home", tmp_path / "stubs"
  (home / "knitjax" / ".venv" / "bin").mkdir(parents=True)
  stubs.mkdir()
  (home / "knitjax" / ".venv" / "bin" / "activate").write_text(f'PATH="{stubs}:$PATH"\n')
  _executable(stubs / "python", '#!/bin/sh\necho "RAY_AUTH_MODE=${RAY_AUTH_MODE:-unset}" > ~/env\n')
  env = {**os.environ, "HOME": str(home)}
  env.pop("RAY_AUTH_MODE", None)
  for token, want in ((False, "unset"), (True, "token")):
    if token:
      (home / ".ray").mkdir(mode=0o700)
      (home / ".ray" / "auth_token").write_text(TOKEN)
    result = _run_remote(_remote(run), home, env)
    assert result.returncode == 0, result.stderr
    pid = int((home / "knitjax-run.pid").read_text())
    _wait_for(lambda pid=pid: not _alive(pid))  # the stub trainer wrote ~/env and exited
    assert (home / "env").read_text() == f"RAY_AUTH_MODE={want}\n"
    (home / "env").unlink()


def test_ray_stop_stops_ray_on_every_worker(tmp_path):
  (stop,) = _commands(tmp_path, "ray-stop", *UP[:2])
  assert _worker(stop) == "--worker=all" and "ray stop" in _remote(stop)


_RAY_DOC = "$ KNITJAX_RAY_TOKEN_FILE=ray_token launch/tpu_vm.sh --dry-run "


def test_readme_shows_what_the_ray_dry_runs_print(tmp_path):
  """launch/README.md's dry run of ray-head (no token yet) and ray-workers (with one), byte for
  byte; ``KNITJAX_UPDATE_DOCS=1`` rewrites it, as for the other blocks."""
  env = {**os.environ, "KNITJAX_RAY_TOKEN_FILE": "ray_token"}
  want = ""
  for args in (
    ["ray-head", "kj-train", "europe-west4-b"],
    ["ray-workers", "kj-roll", "europe-west4-b", HEAD],
  ):
    result = subprocess.run(
      ["bash", SCRIPT, "--dry-run", *args], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    want += _RAY_DOC + " ".join(args) + "\n" + result.stdout
    (tmp_path / "ray_token").write_text(TOKEN)
  with open(_README) as f:
    text = f.read()
  before, rest = text.split("```\n" + _RAY_DOC, 1)
  block, after = rest.split("```\n", 1)
  if os.environ.get("KNITJAX_UPDATE_DOCS") == "1":
    with open(_README, "w") as f:
      f.write(before + "```\n" + want + "```\n" + after)
    return
  assert _RAY_DOC + block == want, "launch/README.md: the Ray dry runs differ from the script's"
