"""Part of the fault suite: every command-line entry point fed what a hurried or hostile user types.

Each case runs one command (``knitjax.main``, ``knitjax.eval``, ``knitjax.export``,
``knitjax.chat``) as its own process, with a time limit, on input that must be refused: a
workdir that is a file, mistyped or read-only; an output folder that holds something else;
absurd sizes (``10**12`` slots, a model config of 100,000 layers, a billion new tokens); a
retired field. A case is counted as

- rejected: a non-zero exit whose last stderr line is one sentence starting ``error:``; it should
  also name the field, file or flag (else ``not_named`` too);
- tracebacks: a Python traceback on stderr;
- silent_accepts: exit status 0;
- hangs: no exit within the case's limit (the process group is killed);
- data_losses: the case's own check of what must survive failed (e.g. a user's file in an export
  folder is gone).

Read-only cases need a read-only bind mount (root on Linux); without it they are skipped and
listed under ``skipped``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable

from lab import without_device_count

COUNTERS = (
  "cases",
  "rejected",
  "tracebacks",
  "silent_accepts",
  "not_one_sentence",
  "not_named",
  "hangs",
  "data_losses",
)
TIMEOUT_S = 120.0
# Each command gets this much address space: an absurd size that the code tries to allocate fails
# there (and counts as a traceback) instead of taking the machine's memory.
MEMORY_BYTES = 8 << 30
_CONFIG = "configs/arith_tiny.py:quick"


@dataclasses.dataclass(frozen=True)
class Case:
  """One command that must be refused.

  Attributes:
    name: ``<entry point>/<what>``.
    argv: the command after ``python -m``.
    names: the error line must contain one of these.
    env: extra environment variables.
    survives: after the command, a check that what must not be lost is intact (None: nothing).
    timeout_s: the command's limit; past it the case is a hang.
  """

  name: str
  argv: tuple[str, ...]
  names: tuple[str, ...]
  env: dict = dataclasses.field(default_factory=dict)
  survives: Callable[[], bool] | None = None
  timeout_s: float = TIMEOUT_S


_HELD: list = []  # sockets the cases hold open (a port in use)


def _python(*argv: str) -> tuple[str, ...]:
  return (sys.executable, "-m", *argv)


def _env(extra: dict) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("KNITJAX_ROLLOUT_TOKEN", None)  # a case's token is the one it sets, or the workdir's
  # as a user's shell: the config's mesh.cpu_devices decides
  return {**without_device_count(env), **extra}


def run_command(argv, env: dict, timeout_s: float, cwd: str) -> tuple[int | None, str, float]:
  """Runs ``argv`` in its own process group; (exit status or None on timeout, stderr, seconds)."""
  t0 = time.monotonic()
  with warnings.catch_warnings():  # JAX warns of any fork; this one execs at once
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
    proc = _popen(argv, cwd, env)
  try:
    _, err = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.communicate()
    return None, err, time.monotonic() - t0
  return proc.returncode, err, time.monotonic() - t0


def _popen(argv, cwd: str, env: dict) -> subprocess.Popen:
  return subprocess.Popen(
    argv,
    cwd=cwd,
    env=env,
    stdin=subprocess.DEVNULL,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
    errors="replace",
    start_new_session=True,
    preexec_fn=_limit_memory,
  )


def _limit_memory() -> None:
  resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def classify(rc: int | None, stderr: str, names: tuple[str, ...]) -> list[str]:
  """The counters one finished command adds to (see the module docstring)."""
  if rc is None:
    return ["hangs"]
  if "Traceback (most recent call last)" in stderr:
    return ["tracebacks"]
  if rc == 0:
    return ["silent_accepts"]
  lines = [line for line in stderr.strip().splitlines() if line.strip()]
  last = lines[-1] if lines else ""
  out = ["rejected"]
  if not last.startswith("error:") or last.count(". ") > 2:
    out.append("not_one_sentence")
  if not any(n in last for n in names):
    out.append("not_named")
  return out


def _mount_read_only(src: str, dst: str) -> bool:
  """Bind-mounts ``src`` read-only at ``dst``; False where that is not possible (not root)."""
  os.makedirs(dst, exist_ok=True)
  if os.geteuid() != 0 or not shutil.which("mount"):
    return False
  ok = subprocess.run(["mount", "--bind", src, dst], capture_output=True).returncode == 0
  if ok and subprocess.run(["mount", "-o", "remount,bind,ro", dst], capture_output=True).returncode:
    subprocess.run(["umount", dst], capture_output=True)
    return False
  return ok


def _unmount(dst: str) -> None:
  subprocess.run(["umount", dst], capture_output=True)


def clear_mounts(root: str) -> None:
  """Unmounts what a killed earlier run of this part left mounted under ``root``."""
  with open("/proc/mounts") as f:
    points = [line.split()[1] for line in f]
  for point in sorted(points, reverse=True):
    if point == root or point.startswith(root + os.sep):
      subprocess.run(["umount", "-l", point], capture_output=True)


def _hf_folder(path: str, **config_changes) -> str:
  """A tiny Hugging Face checkpoint folder (weights and config; see `knitjax.models.hf`)."""
  from flax import nnx

  from knitjax.models import hf
  from knitjax.models.transformer import Transformer, TransformerConfig

  config = TransformerConfig(
    vocab_size=64, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn_dim=24
  )
  shutil.rmtree(path, ignore_errors=True)
  hf.save_hf_params(Transformer(config, rngs=nnx.Rngs(0)), config, path)
  file = os.path.join(path, hf.CONFIG_FILE)
  with open(file) as f:
    d = json.load(f)
  d.update(config_changes)
  with open(file, "w") as f:
    json.dump(d, f)
  return path


def _read(path: str) -> str | None:
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    return None


def _write(path: str, text: str, mode: int = 0o600) -> str:
  with open(path, "w") as f:
    f.write(text)
  os.chmod(path, mode)
  return path


def cases(scratch: str, trained: str, ro_trained: str | None, ro_empty: str | None) -> list[Case]:
  """The cases; ``trained`` is a workdir with a checkpoint, ``ro_*`` read-only mounts or None."""
  s = lambda *p: os.path.join(scratch, *p)
  os.makedirs(s("files"), exist_ok=True)
  a_file = _write(s("files", "not_a_folder"), "x")
  main = lambda *a, **kw: _python("knitjax.main", "--config", kw.get("config", _CONFIG), *a)
  out: list[Case] = []

  # knitjax.main: the workdir, absurd sizes, and a model config that would take forever to build
  out.append(Case("main/workdir_is_a_file", main("--workdir", a_file), (a_file, "workdir")))
  for field in (
    "rollout.group_size",
    "rollout.max_new_tokens",
    "rollout.slots",
    "rollout.decode_steps",
    "rollout.refill_groups",
    "mesh.cpu_devices",
  ):
    out.append(
      Case(
        f"main/{field}=10**12",
        main("--workdir", s("w", field), f"--config.{field}={10**12}"),
        (field,),
      )
    )
  huge = {"num_hidden_layers": 100_000, "hidden_size": 1 << 20, "vocab_size": 10**9}
  for key, value in huge.items():
    folder = _hf_folder(s("models", key), **{key: value})
    out.append(
      Case(
        f"main/init_from_{key}={value}",
        main("--workdir", s("w", f"huge_{key}"), f"--config.init_from={folder}"),
        (key, folder, "memory", "bytes"),
        timeout_s=60.0,
      )
    )
  # --distributed start-up: flags refused before JAX starts; a partner that never comes.
  held = socket.socket()  # a port someone holds, for as long as the cases exist
  held.bind(("127.0.0.1", 0))
  held.listen()
  port = held.getsockname()[1]
  _HELD.append(held)
  dist = lambda w, *a: main("--workdir", s("w", w), "--distributed", *a)  # noqa: E731
  for what, flags, names in (
    ("process_id_out_of_range", ("--num_processes=2", "--process_id=2"), ("--process_id",)),
    ("num_processes_0", ("--num_processes=0", "--process_id=0"), ("--num_processes",)),
    ("address_without_port", ("--coordinator_address=127.0.0.1",), ("--coordinator_address",)),
    ("unresolvable_host", ("--coordinator_address=no-such-host.invalid:1234",), ("no-such-host",)),
    ("port_in_use", (f"--coordinator_address=127.0.0.1:{port}",), (str(port),)),
    ("partner_never_starts", ("--process_id=1", "--join_timeout_s=3"), ("waited 3 s",)),
  ):
    base = () if "--num_processes" in " ".join(flags) else ("--num_processes=2",)
    if "--process_id" not in " ".join(flags):
      base += ("--process_id=0",)
    if "--coordinator_address" not in " ".join(flags):
      base += (f"--coordinator_address=127.0.0.1:{port + 1}",)
    out.append(Case(f"main/distributed_{what}", dist(what, *base, *flags), names, timeout_s=90.0))

  # A retired field (rollout hosts went, issue 45) names what replaced it, in one sentence.
  out.append(
    Case(
      "main/rollout_hosts_retired",
      main(
        "--workdir",
        s("w", "rollout_hosts"),
        "--config.topology.rollout_hosts=1",
        config="configs/arith_disagg.py:quick",
      ),
      ("rollout_hosts", "rollout_workers"),
      timeout_s=60.0,
    )
  )

  # knitjax.eval and knitjax.export: workdirs that hold no run, outputs that hold something else
  missing = s("w", "mistyped_workdir")
  no_run = lambda: not os.path.exists(missing)
  eval_ = lambda w, *a: _python("knitjax.eval", "--config", _CONFIG, "--workdir", w, *a)
  export = lambda w, o, *a: _python(
    "knitjax.export", "--config", _CONFIG, "--workdir", w, "--out", o, *a
  )
  out.append(Case("eval/workdir_is_a_file", eval_(a_file), (a_file,)))
  out.append(Case("eval/mistyped_workdir", eval_(missing), (missing,), survives=no_run))
  out.append(Case("export/workdir_is_a_file", export(a_file, s("out", "a")), (a_file,)))
  out.append(
    Case("export/mistyped_workdir", export(missing, s("out", "b")), (missing,), survives=no_run)
  )
  out.append(Case("export/out_is_a_file", export(trained, a_file), (a_file,)))
  users = s("out", "users_folder")
  os.makedirs(users, exist_ok=True)
  kept = _write(os.path.join(users, "config.json"), '{"mine": true}\n')
  out.append(
    Case(
      "export/out_not_empty",
      export(trained, users),
      (users,),
      survives=lambda: _read(kept) == '{"mine": true}\n',
    )
  )
  # an --out that would take the run with it (issue 47: both deleted the checkpoints)
  run_files = lambda: sorted(
    os.path.relpath(os.path.join(d, f), trained) for d, _, fs in os.walk(trained) for f in fs
  )
  kept_run = run_files()
  run_intact = lambda: run_files() == kept_run
  for name, target in (("out_is_the_workdir", trained), ("out_holds_the_workdir", scratch)):
    out.append(
      Case(f"export/{name}", export(trained, target, "--overwrite"), (target,), survives=run_intact)
    )
  if ro_trained:
    out.append(Case("eval/read_only_workdir", eval_(ro_trained), (ro_trained,)))
  if ro_empty:
    out.append(Case("export/read_only_out", export(trained, ro_empty), (ro_empty,)))

  # knitjax.chat
  out.append(
    Case(
      "chat/max_new_tokens=10**9",
      _python(
        "knitjax.chat",
        f"--init_from={_hf_folder(s('models', 'chat'))}",
        "--max_new_tokens=1000000000",
      ),
      ("max_new_tokens",),
    )
  )
  out.append(
    Case(
      "chat/init_from_missing",
      _python("knitjax.chat", f"--init_from={s('models', 'missing')}"),
      (s("models", "missing"),),
    )
  )
  return out


def run(workdir: str, repo: str) -> dict:
  """Runs every case; returns ``{"by_entry": {...}, "cases": [...], "skipped": [...]}``."""
  workdir = os.path.abspath(workdir)
  clear_mounts(workdir)
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  trained = os.path.join(workdir, "trained")
  rc, err, _ = run_command(
    _python("knitjax.main", "--config", _CONFIG, "--workdir", trained, "--config.loop.steps=1"),
    _env({}),
    600,
    repo,
  )
  if rc != 0:
    raise RuntimeError(f"the reference run failed ({rc}): {err[-2000:]}")
  mounts = []
  ro_trained = os.path.join(workdir, "ro_trained")
  ro_empty = os.path.join(workdir, "ro_empty")
  os.makedirs(os.path.join(workdir, "empty"), exist_ok=True)
  skipped = []
  for src, dst in ((trained, ro_trained), (os.path.join(workdir, "empty"), ro_empty)):
    if _mount_read_only(src, dst):
      mounts.append(dst)
    else:
      skipped.append(f"{os.path.basename(dst)}: no read-only bind mount (needs root and mount)")
  try:
    results = []
    table: dict[str, dict[str, int]] = {}
    for case in cases(
      workdir,
      trained,
      ro_trained if ro_trained in mounts else None,
      ro_empty if ro_empty in mounts else None,
    ):
      rc, err, seconds = run_command(case.argv, _env(case.env), case.timeout_s, repo)
      outcome = classify(rc, err, case.names)
      if case.survives is not None and not case.survives():
        outcome.append("data_losses")
      lines = [line for line in err.strip().splitlines() if line.strip()]
      results.append(
        {
          "case": case.name,
          "outcome": outcome,
          "exit": rc,
          "seconds": round(seconds, 1),
          "last_line": lines[-1][:400] if lines else "",
        }
      )
      entry = case.name.split("/")[0]
      counts = table.setdefault(entry, dict.fromkeys(COUNTERS, 0))
      counts["cases"] += 1
      for name in outcome:
        counts[name] += 1
      print(f"  {case.name}: {','.join(outcome)} ({seconds:.0f} s)", flush=True)
  finally:
    for dst in mounts:
      _unmount(dst)
  return {"by_entry": table, "cases": results, "skipped": skipped}
