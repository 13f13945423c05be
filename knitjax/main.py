"""Training entry: ``python -m knitjax.main --config configs/<x>.py --workdir DIR``.

This file is intentionally kept short: it parses flags, optionally starts
multi-host JAX, and calls :func:`knitjax.run.train`.
"""

import json
import os
import sys

from absl import flags, logging
from ml_collections import config_flags

from knitjax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and plots go here.")
_DISTRIBUTED = flags.DEFINE_bool(
  "distributed", False, "Call jax.distributed.initialize() (multi-host runs)."
)
# Not needed on TPU VMs, Slurm or Open MPI, where JAX finds them itself; set all three elsewhere
# (several CPU processes, for one). JAX_COORDINATOR_ADDRESS is honoured as well.
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address", None, "With --distributed: host:port of process 0's coordinator."
)
_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes", None, "With --distributed: how many processes the run has."
)
_PROCESS_ID = flags.DEFINE_integer(
  "process_id", None, "With --distributed: this process's index, 0..num_processes-1."
)
_JOIN_TIMEOUT = flags.DEFINE_integer(
  "join_timeout_s",
  300,
  "With --distributed: how long a process waits for the run's other processes to start.",
)
flags.mark_flags_as_required(["config", "workdir"])


def stopped(how: str) -> str:
  """``stopped by Ctrl-C after step 3; rerun the same command to resume from checkpoint 2.``

  The step is the last one ``metrics.jsonl`` records; the checkpoint the newest finished one (a
  save still in flight is either finished by the exit or left as a temp folder, never read).
  """
  from knitjax.runtime.metrics import read_metrics
  from knitjax.runtime.preflight import checkpoint_steps

  steps = checkpoint_steps(_WORKDIR.value)
  rows = read_metrics(_WORKDIR.value)
  at = f"after step {rows[-1]['step']}" if rows else "before a step finished"
  then = f"resume from checkpoint {steps[-1]}" if steps else "start (no checkpoint was written)"
  return f"stopped by {how} {at}; rerun the same command to {then}."


def _join(address: str | None, processes: int | None, index: int | None, bind: dict) -> None:
  """``jax.distributed.initialize``, ended in one sentence if the others do not come.

  JAX's own limit ends a process that waited too long with a native stack trace (process 0)
  or an unexplained error; a timer a little shorter says which process waited for whom.
  """
  import threading

  import jax

  wait_s = _JOIN_TIMEOUT.value
  if wait_s < 1:
    sys.exit(f"error: --join_timeout_s={wait_s} is not accepted; give 1 or more seconds.")

  def never_joined():
    who = "the coordinator of process 0" if index else "the run's other processes"
    sys.stderr.write(
      f"error: trainer process {index} waited {wait_s} s for {who} at {address} "
      f"({processes} processes in all) and stops; start every process with the same "
      "--coordinator_address and --num_processes (and process 0 first).\n"
    )
    sys.stderr.flush()
    os._exit(1)

  timer = threading.Timer(wait_s, never_joined)
  timer.daemon = True
  timer.start()
  try:
    jax.distributed.initialize(
      address,
      num_processes=processes,
      process_id=index,
      initialization_timeout=wait_s + 30,
      **bind,
    )
  finally:
    timer.cancel()


def stopped_how() -> str:
  """What to do after a run stopped on an error: rerun, from which checkpoint."""
  from knitjax.runtime.preflight import checkpoint_steps

  steps = checkpoint_steps(_WORKDIR.value)
  then = f"resume from checkpoint {steps[-1]}" if steps else "start again (no checkpoint yet)"
  return f"Rerun the same command to {then}."


def main(argv, *, on_batch=None):
  """Runs the command line's job; ``on_batch`` reaches :func:`knitjax.run.train`."""
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
    address, n, k = _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value
    if problem := cli.distributed_flags_problem(address, n, k):
      sys.exit(f"error: {problem}")
    if jax.config.jax_cpu_collectives_implementation in (None, "none"):  # older JAX: no default
      jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes need it
    # Process 0's coordinator listens on the address it was given (loopback stays loopback),
    # not on every interface.
    bind = {"coordinator_bind_address": address} if address and k == 0 else {}
    _join(address, n, k, bind)
  from knitjax.run import train

  logging.info("devices: %s", jax.devices())
  try:
    config_name = config_flags.get_config_filename(flags.FLAGS["config"])
    final = train(config, _WORKDIR.value, on_batch=on_batch, config_name=config_name)
  except (ValueError, FileNotFoundError, TimeoutError) as e:
    sys.exit(f"error: {e}")
  except Exception as e:
    from knitjax.distributed.coordination import PULSE_S, SILENCE_S, peer_left, said
    from knitjax.distributed.local_ray import ray_failure

    # A collective failed because another process stopped; one killed outright is named by the
    # pulse watch once its silence is long enough (it then ends this process in one sentence).
    failed_collective = isinstance(e, jax.errors.JaxRuntimeError)
    if sentence := peer_left(wait_s=SILENCE_S + 5 * PULSE_S if failed_collective else 0.0):
      sys.exit(f"error: {said(sentence)}")
    if sentence := ray_failure(e):  # an actor or node of the run's Ray cluster is gone
      sys.exit(f"error: {sentence} {stopped_how()}")
    raise
  # Every process reports what it holds (param_norm is read from its own replica of the params).
  keys = ("step", "version", "loss", "param_norm", "weight_publish_bytes")
  summary = {k: final[k] for k in keys if k in final}
  logging.info(
    "process %d of %d finished: %s", jax.process_index(), jax.process_count(), json.dumps(summary)
  )


if __name__ == "__main__":
  cli.run(main, stopped=stopped)
