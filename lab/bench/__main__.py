"""Benchmark entry: ``python -m lab.bench --config configs/bench/<x>.py --workdir DIR``.

The config's ``bench`` field names a module ``lab.bench.<bench>`` whose
``run(config, workdir) -> dict`` writes ``DIR/<bench>.json`` (and a PNG plot)
and prints a short table. Every field of the config can be overridden with
``--config.<field>=<value>``.
"""

import importlib
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from knitjax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Benchmark config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for JSON results and plots.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  cli.quiet_libraries()
  config = _CONFIG.value
  name = config.get("bench")
  if not name:
    sys.exit("error: the benchmark config has no 'bench' field naming the benchmark to run.")
  try:
    module = importlib.import_module(f"lab.bench.{name}")
  except ModuleNotFoundError:
    sys.exit(f"error: config.bench={name!r} names no module lab/bench/{name}.py.")
  # Fake CPU devices must be requested before JAX starts (harmless on TPU/GPU).
  cpu_devices = config.get("cpu_devices", 0)
  if cpu_devices and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={cpu_devices}"
    )
  os.makedirs(_WORKDIR.value, exist_ok=True)
  try:
    module.run(config, _WORKDIR.value)
  except ValueError as e:  # user-caused: bad workload or config values
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
