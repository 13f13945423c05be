"""Benchmark entry: ``python -m lab.bench --config configs/bench/<x>.py --workdir DIR``.

The config's ``bench`` field names a module ``lab.bench.<bench>`` whose
``run(config, workdir) -> dict`` writes ``DIR/<bench>.json`` (and a PNG plot)
and prints a short table. Every field of the config can be overridden with
``--config.<field>=<value>``. A benchmark is a module with a config of its own,
``configs/bench/<bench>.py``; the config run must have that config's fields. A
benchmark module's ``check_config(config)``, where it has one, runs before the workdir is made.
"""

import importlib
import os
import pathlib
import sys

from absl import app, flags
from ml_collections import config_flags

from knitjax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Benchmark config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for JSON results and plots.")
flags.mark_flags_as_required(["config", "workdir"])

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs" / "bench"


def benches() -> list[str]:
  """The benchmarks: each has a config ``configs/bench/<name>.py`` (and a module of the name)."""
  return sorted(p.stem for p in CONFIGS.glob("*.py") if not p.stem.startswith("_"))


def load_config():
  """The ``--config`` ConfigDict, or exit with one sentence when its file cannot be loaded."""
  path = config_flags.get_config_filename(flags.FLAGS["config"]).split(":", 1)[0]  # no variant
  if not os.path.isfile(path):
    sys.exit(
      f"error: --config {path} is not a file; give a benchmark config, configs/bench/<name>.py "
      f"(one of: {', '.join(benches())})."
    )
  try:
    return _CONFIG.value
  except (OSError, ValueError) as e:  # a config file that failed to load surfaces here
    sys.exit(f"error: --config {path} could not be loaded: {cli.one_line(e)}")


def bench_problem(config) -> str | None:
  """Why ``config.bench`` cannot run this config (not a benchmark, or another benchmark's
  config), else None."""
  name = config.get("bench")
  if not name:
    return "the benchmark config has no 'bench' field naming the benchmark to run."
  if name not in benches():
    return f"config.bench={name!r} is not a benchmark; choose one of: {', '.join(benches())}."
  own = importlib.import_module(f"configs.bench.{name}").get_config()
  missing = sorted(set(own) - set(config))
  if missing:
    return (
      f"config.bench={name!r} does not fit this config, which lacks {name}'s fields "
      f"({', '.join(missing[:5])}); run --config configs/bench/{name}.py for {name}."
    )
  return None


def main(argv):
  del argv
  cli.quiet_libraries()
  config = load_config()
  if problem := bench_problem(config):
    sys.exit(f"error: {problem}")
  name = config.bench
  module = importlib.import_module(f"lab.bench.{name}")
  # Fake CPU devices must be requested before JAX starts (harmless on TPU/GPU).
  cpu_devices = config.get("cpu_devices", 0)
  if cpu_devices and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={cpu_devices}"
    )
  try:
    check_run(module, config, _WORKDIR.value)
    module.run(config, _WORKDIR.value)
  except ValueError as e:  # user-caused: bad workload or config values
    sys.exit(f"error: {e}")


def check_run(module, config, workdir: str) -> None:
  """Raises ValueError (one sentence) for a bad field of the bench (its ``check_config``), then
  for a workdir that cannot hold its results (a file, under /proc); makes the workdir."""
  from etils import epath

  from knitjax.runtime.preflight import check_writable

  if check := getattr(module, "check_config", None):
    check(config)
  check_writable(epath.Path(workdir), f"--workdir {workdir}", create=True)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
