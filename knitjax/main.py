"""Training entry: ``python -m knitjax.main --config configs/<x>.py --workdir DIR``.

This file is intentionally kept short: it parses flags, optionally starts
multi-host JAX, and calls :func:`knitjax.runtime.train.train`.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from knitjax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and plots go here.")
_DISTRIBUTED = flags.DEFINE_bool(
  "distributed", False, "Call jax.distributed.initialize() (multi-host runs)."
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  cli.quiet_libraries()
  from knitjax.config import from_config_dict

  try:
    config = from_config_dict(_CONFIG.value)
  except (OSError, ValueError) as e:  # a config file that failed to load surfaces here
    sys.exit(f"error: {cli.one_line(e)}")
  cli.request_cpu_devices(config.mesh.cpu_devices)
  import jax

  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  from knitjax.runtime.train import train

  logging.info("devices: %s", jax.devices())
  try:
    train(config, _WORKDIR.value)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
