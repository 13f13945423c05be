"""``knitjax.run.train``: the one library call behind ``python -m knitjax.main`` and the notebooks.

It chooses the run's topology once (`knitjax.distributed.topology.choose`) and hands it to the
loop of ``config.topology.mode``.
"""

from __future__ import annotations

from collections.abc import Callable

from knitjax.config import Config


def train(
  config: Config,
  workdir: str,
  *,
  on_step: Callable[[int, dict], None] | None = None,
  on_batch: Callable | None = None,
  config_name: str | None = None,
) -> dict:
  """Runs (or resumes) training as ``config.topology.mode`` says; returns the last step's metrics.

  ``config_name`` (the config's file and variant, ``configs/arith_tiny.py:quick``) titles the
  reward plot. ``on_step(step, metrics)`` runs after each train step; ``on_batch(mini-batch,
  train batch)`` in each process before each update, with that process's shards of the batch.

  Raises:
    ValueError: one step needs more memory than this machine has
      (:mod:`knitjax.config_memory`), the work directory cannot hold this run (see
      :mod:`knitjax.runtime.preflight`), or another run holds it
      (:mod:`knitjax.runtime.workdir_lock`).
  """
  import jax

  from knitjax.config_memory import check_memory
  from knitjax.distributed.topology import choose
  from knitjax.runtime import workdir_lock
  from knitjax.runtime.preflight import check_workdir

  check_memory(config, processes=jax.process_count())  # before the workdir is made
  check_workdir(config, workdir)
  if jax.process_count() > 1:  # every process holds the same run before anything is built
    from knitjax.distributed.coordination import check_one_run

    check_one_run(config, workdir)
  with workdir_lock.hold(workdir, primary=jax.process_index() == 0):
    topology = choose(config, workdir=_local(workdir))
    if config.topology.mode == "colocated":
      from knitjax.runtime import colocated

      return colocated.run(
        config, workdir, topology, on_step=on_step, on_batch=on_batch, config_name=config_name
      )
    from knitjax.runtime import disaggregated

    return disaggregated.run(
      config, workdir, topology, on_step=on_step, on_batch=on_batch, config_name=config_name
    )


def _local(workdir: str) -> str:
  """The workdir where a run's Ray token can be kept (a local folder), else empty."""
  from knitjax.workdir import is_remote

  return "" if is_remote(workdir) else workdir
