"""``python -m knitjax.main``: bad input ends in one clear line, never a traceback."""

import logging
import os
import re
import subprocess
import sys

import pytest

from configs import arith_tiny
from knitjax import cli
from knitjax.config import from_config_dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
  "field, value, expected",
  [
    ("loss.aggregation", "mean", "config.loss.aggregation='mean' is not accepted"),
    ("task.reward", "nope", "config.task.reward='nope' is not accepted; choose one of"),
    ("admission.minibatches", 3, "not divisible by config.admission.minibatches=3"),
    ("admission.policy", "fifo", "choose one of: train_batch, minibatch, greedy"),
    ("topology.mode", "async", "choose one of: colocated, disaggregated"),
    ("rollout.top_p", 0.0, "config.rollout.top_p=0.0"),
    ("optimizer.lr", "fast", "config.optimizer.lr='fast' has the wrong type; expected float"),
    (
      "optimizer.lr",
      float("nan"),
      "config.optimizer.lr=nan is not accepted; it must be a finite number",
    ),
    (
      "optimizer.lr",
      float("inf"),
      "config.optimizer.lr=inf is not accepted; it must be a finite number",
    ),
    (
      "admission.quotas",
      {"arith": "32"},
      "config.admission.quotas={'arith': '32'} has the wrong type; expected a mapping of str",
    ),
    # colocated (arith_tiny) checks the per-class budgets exactly as disaggregated does
    ("rollout.class_max_new_tokens", {"arith": 99}, "class_max_new_tokens['arith']=99"),
    ("rollout.class_max_new_tokens", {"nope": 2}, "names ['nope'], which are not quota classes"),
    (
      "layout.micro_batches",
      3,
      "config.layout.micro_batches=3 does not divide a mini-batch of 256",
    ),
  ],
)
def test_bad_config_names_the_field(field, value, expected):
  c = arith_tiny.get_config().to_dict()
  section, key = field.split(".")
  c[section][key] = value
  with pytest.raises(ValueError, match=re.escape(expected)):
    from_config_dict(c)


def test_unknown_field_is_named():
  c = arith_tiny.get_config().to_dict()
  c["optimizer"]["lrr"] = 1.0
  with pytest.raises(
    ValueError, match=r"config.optimizer.lrr is not a known field; known fields: .*lr"
  ):
    from_config_dict(c)


@pytest.mark.parametrize(
  "error, expected",
  [
    # what ml_collections raises for `--config.train.lrr=1` (a KeyError inside an AttributeError)
    (
      AttributeError(KeyError('\'lrr\'\nDid you mean "lr" instead of "lrr"?')),
      'unknown config field lrr. Did you mean "lr" instead of "lrr"?',
    ),
    (AttributeError(KeyError("'nosuch'")), "unknown config field nosuch"),
    (KeyError("'nosuch'"), "unknown config field nosuch"),
  ],
)
def test_unknown_field_line_has_no_stray_quote(error, expected):
  assert cli.one_line(error) == expected


def test_quiet_libraries_drops_the_backend_probe_lines_not_warnings():
  def record(name, level, pathname="x.py"):
    return logging.LogRecord(name, level, pathname, 1, "msg", None, None)

  quiet = cli._QuietLibraries()
  assert not quiet.filter(record("jax._src.xla_bridge", logging.INFO))
  assert quiet.filter(record("jax._src.xla_bridge", logging.WARNING))
  assert not quiet.filter(record("absl", logging.INFO, "/site-packages/orbax/checkpoint/x.py"))
  assert quiet.filter(record("absl", logging.INFO, "/work/knitjax/runtime/metrics.py"))


def test_no_libtpu_line_when_jax_starts_on_a_cpu_machine():
  # JAX probes every backend it knows when JAX_PLATFORMS is unset; without libtpu it logs
  # "Unable to initialize backend 'tpu': ... libtpu.so" at INFO, which an entry point drops.
  script = (
    "from absl import app, logging\n"
    "from knitjax import cli\n"
    "def main(argv):\n"
    "  cli.quiet_libraries()\n"
    "  import jax\n"
    "  logging.info('devices: %s', jax.devices())\n"
    "app.run(main)\n"
  )
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  env["PYTHONPATH"] = REPO
  proc = subprocess.run(
    [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == 0, proc.stderr[-1500:]
  assert "devices: [" in proc.stderr
  assert "Unable to initialize backend" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
  "args, expected",
  [
    (["--config.optimizer.lrr=1"], 'unknown config field lrr. Did you mean "lr" instead of "lrr"?'),
    (["--config.train.lr=1e-4"], "config.train.lr is now config.optimizer.lr."),
    (["--config.runtime.steps=3"], "config.runtime.steps is now config.loop.steps."),
    (["--config.admission.minibatches=3"], "not divisible"),
    (["--config=configs/missing.py"], "No such file or directory"),
    (["--config.optimizer.lr=abc"], "could not convert string to float"),
    (["--config.optimizer.lr=nan"], "config.optimizer.lr=nan is not accepted"),
    (["--config=tests/data/bad_configs/name_error.py"], "name_error.py:8: NameError: name"),
    (["--config=tests/data/bad_configs/syntax_error.py"], "syntax_error.py:6: SyntaxError"),
  ],
)
def test_main_exits_with_one_line(tmp_path, args, expected):
  cmd = [
    sys.executable,
    "-m",
    "knitjax.main",
    "--config",
    "configs/arith_tiny.py",
    "--workdir",
    str(tmp_path),
    *args,
  ]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error:") and expected in last, proc.stderr[-1500:]
  assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", ["arith_tiny", "arith_disagg", "count_vlm_tiny"])
def test_every_config_field_can_be_set_on_the_shipped_configs(name):
  """`--config.topology.storage=ray`, `--config.rollout.engine=...`, `--config.init_from=...`: a
  flag override needs the field in the ConfigDict, so every shipped config carries them all."""
  import dataclasses
  import importlib

  from knitjax.config import SECTIONS

  c = importlib.import_module(f"configs.{name}").get_config()
  missing = [
    f"{section}.{f.name}"
    for section, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
    if f.name not in c[section]
  ]
  assert missing == [] and "init_from" in c
  c.topology.storage, c.topology.rollout_workers, c.rollout.engine = "ray", 2, "batched"
  cfg = from_config_dict(c)
  assert (cfg.topology.storage, cfg.topology.rollout_workers, cfg.rollout.engine) == (
    "ray",
    2,
    "batched",
  )


def _main(tmp_workdir, *args):
  cmd = [sys.executable, "-m", "knitjax.main", "--config", "configs/arith_tiny.py:quick"]
  cmd += ["--workdir", str(tmp_workdir), *args]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_workdir_that_is_a_file_is_refused_before_any_compile(tmp_path):
  (tmp_path / "f").write_text("x")
  for workdir, expected in [
    (tmp_path / "f", "is a file, not a folder"),
    (tmp_path / "f" / "sub", "is not writable"),
  ]:
    proc = _main(workdir)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and expected in last, proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr and "restored" not in proc.stderr


def test_steps_below_the_checkpoint_is_refused(tmp_path):
  from knitjax.runtime.preflight import check_workdir

  (tmp_path / "checkpoints" / "5").mkdir(parents=True)
  (tmp_path / "checkpoints" / "7.orbax-checkpoint-tmp-1").mkdir()  # an unfinished save
  config = from_config_dict(arith_tiny.get_config("quick"))  # steps=2
  with pytest.raises(ValueError, match="holds a checkpoint at step 5, past config.loop.steps=2"):
    check_workdir(config, str(tmp_path))
  proc = _main(tmp_path)
  assert proc.returncode != 0 and "past config.loop.steps=2" in proc.stderr.splitlines()[-1]


@pytest.mark.parametrize(
  "corrupt, expected",
  [
    (lambda d: d.__setitem__("loss", None), "config.loss=None is not accepted; it must be a"),
    (lambda d: d["model"].pop("vocab_size"), "config.model.vocab_size is missing"),
    (lambda d: d["admission"].update(quotas={"arith": 0}), "quotas['arith']=0 is not accepted"),
    (
      lambda d: d["admission"].update(min_per_minibatch={"nope": 1}),
      "config.admission.min_per_minibatch names class 'nope'",
    ),
    (
      lambda d: d["admission"].update(max_per_minibatch={"arith": -1}),
      "config.admission.max_per_minibatch['arith']=-1 must be an int >= 0",
    ),
    (lambda d: d["mesh"].update(shape=(-1, -1, 1)), "config.mesh.shape=(-1, -1, 1) is not"),
    (lambda d: d["mesh"].update(shape=(0, 1, 1)), "config.mesh.shape=(0, 1, 1) is not"),
    (lambda d: d.__setitem__("seed", True), "config.seed=True has the wrong type"),
    (lambda d: d["optimizer"].update(b2=-1.0), "config.optimizer.b2=-1.0 is not accepted"),
    (lambda d: d["loss"].update(eps_low=-1.0), "config.loss.eps_low=-1.0 is not accepted"),
    (lambda d: d["task"].update(name="gsm8k"), "config.task.path is empty; task 'gsm8k'"),
    # the field itself is named, not the per-class budgets checked against it
    (lambda d: d["rollout"].update(max_new_tokens=0), "config.rollout.max_new_tokens=0 is not"),
  ],
)
def test_bad_config_found_by_the_fault_suite_is_one_sentence(corrupt, expected):
  """Bad inputs `lab.faults.bad_inputs` generated that were accepted or raised a traceback."""
  d = arith_tiny.get_config().to_dict()
  corrupt(d)
  with pytest.raises(ValueError, match=re.escape(expected)):
    from_config_dict(d)


@pytest.mark.parametrize("how, code", [("Ctrl-C", 130), ("SIGTERM", 143)])
def test_a_stop_is_one_line_with_the_shells_exit_code(how, code, capsys):
  import signal

  def body():
    if how == "Ctrl-C":
      raise KeyboardInterrupt
    signal.raise_signal(signal.SIGTERM)  # delivered to this (the main) thread

  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(SystemExit) as e, cli.stoppable(lambda h: f"stopped by {h} after step 3."):
    body()
  assert e.value.code == code
  assert capsys.readouterr().err == f"stopped by {how} after step 3.\n"
  assert signal.getsignal(signal.SIGTERM) is before  # restored


def test_ctrl_c_in_main_stops_in_one_line_and_names_the_checkpoint(tmp_path):
  import signal
  import time

  cmd = [sys.executable, "-m", "knitjax.main", "--config", "configs/arith_tiny.py:quick"]
  cmd += ["--workdir", str(tmp_path), "--config.loop.steps=100"]
  # The child must start with SIGINT at its default, as a foreground command does: one started
  # from a suite with SIGINT ignored (`nohup pytest &`, a script's background job) inherits the
  # ignore, which Python and knitjax keep (a background job is not meant to see Ctrl-C). A
  # Python handler is reset to the default across exec, so one is set around the start (rather
  # than a preexec_fn, which is unsafe in this process's threads).
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True)
  finally:
    signal.signal(signal.SIGINT, previous)
  try:
    deadline = time.monotonic() + 120
    while not (tmp_path / "checkpoints" / "1").is_dir():
      assert proc.poll() is None and time.monotonic() < deadline, "no step finished"
      time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
  finally:
    proc.kill()  # a failed check must not leave a 100-step run behind
  last = stderr.strip().splitlines()[-1]
  assert proc.returncode == 130, stderr[-2000:]
  assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-2000:]
  found = re.fullmatch(
    r"stopped by Ctrl-C after step (\d+); rerun the same command to resume from checkpoint (\d+)\.",
    last,
  )
  assert found, last
  step, checkpoint = map(int, found.groups())
  assert 1 <= checkpoint <= step and (tmp_path / "checkpoints" / str(checkpoint)).is_dir()


def test_eval_and_export_cli_refuse_a_mistyped_workdir_or_a_used_out(tmp_path):
  """The command lines end in ``error: <one sentence>`` (they used to exit 0 on the random init
  and create the mistyped folder)."""
  base = [sys.executable, "-m"]
  config = ["--config", "configs/arith_tiny.py:quick"]
  (tmp_path / "run" / "checkpoints" / "1").mkdir(parents=True)
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "config.json").write_text("{}")
  cases = [
    (
      ["knitjax.eval", *config, "--workdir", str(tmp_path / "typo")],
      f"error: --workdir {tmp_path / 'typo'} does not exist;",
    ),
    (
      [
        "knitjax.export",
        *config,
        "--workdir",
        str(tmp_path / "run"),
        "--out",
        str(tmp_path / "hf"),
      ],
      f"error: --out {tmp_path / 'hf'} is not empty (it holds config.json); pass --overwrite",
    ),
  ]
  for args, expected in cases:
    proc = subprocess.run(base + args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(expected), proc.stderr[-2000:]
  assert not (tmp_path / "typo").exists()
  assert (tmp_path / "hf" / "config.json").read_text() == "{}"


def test_orbax_tracebacks_of_a_full_disk_are_dropped_other_errors_pass():
  """The checkpointer names a full disk in one sentence; orbax's threads each logged a traceback
  of it (46 of them, 700 lines, in a real run)."""
  orbax = "/site-packages/orbax/checkpoint/_src/x.py"

  def record(name, message, error=None, pathname=orbax):
    exc_info = (type(error), error, None) if error is not None else None
    return logging.LogRecord(name, logging.ERROR, pathname, 1, message, None, exc_info)

  quiet = cli._QuietLibraries()
  tensorstore = ValueError("RESOURCE_EXHAUSTED: Failed writing: No space left on device")
  assert not quiet.filter(record("absl", "_SignalingThread.run() raised", tensorstore))
  assert not quiet.filter(record("absl", "Failed to run 4 commit operations", OSError(28, "x")))
  assert not quiet.filter(
    record("asyncio", "Future exception was never retrieved", tensorstore, "a")
  )
  assert quiet.filter(record("absl", "Failed to run commit operations", OSError(13, "denied")))
  assert quiet.filter(record("absl", "No space left on device", pathname="knitjax/x.py"))


def test_distributed_flags_are_checked_before_jax_starts():
  """--distributed's flags: one sentence each, and process 0 refuses a port someone holds."""
  import socket

  from knitjax.cli import distributed_flags_problem as problem

  assert problem("127.0.0.1:0", 2, 1) is not None  # port 0
  assert "--num_processes=0" in problem(None, 0, 0)
  assert "--process_id=2 is not accepted; give 0..1" in problem(None, 2, 2)
  assert "--process_id=-1" in problem(None, 2, -1)
  assert "host:port" in problem("127.0.0.1", 2, 0)
  assert "does not resolve" in problem("no-such-host.invalid:1234", 2, 1)
  with socket.socket() as held:  # another run's coordinator, or any program, on the port
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    assert "cannot be listened on" in problem(f"127.0.0.1:{port}", 2, 0)
    assert problem(f"127.0.0.1:{port}", 2, 1) is None  # the others connect to it
  assert problem(f"127.0.0.1:{port}", 2, 0) is None


def test_a_process_whose_partners_never_start_stops_in_one_sentence(tmp_path):
  """Process 1 with no process 0: JAX would wait 300 s and end without a word on who was
  missing; --join_timeout_s bounds the wait and the last line names what it waited for."""
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  cmd = [sys.executable, "-m", "knitjax.main", "--config", "configs/arith_tiny.py:quick"]
  cmd += ["--workdir", str(tmp_path / "w"), "--distributed", "--num_processes=2"]
  cmd += ["--process_id=1", f"--coordinator_address=127.0.0.1:{port}", "--join_timeout_s=3"]
  p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
  last = p.stderr.strip().splitlines()[-1]
  assert p.returncode == 1, p.stderr[-2000:]
  assert last.startswith("error: trainer process 1 waited 3 s for the coordinator"), last
