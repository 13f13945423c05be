"""The run loop: train steps over a `Pipe`, and the step tail every execution shares.

A `Pipe` is where a run's mini-batches come from and what surrounds each update: the colocated
step source (`knitjax.runtime.colocated`) generates each step's groups in turn, the
disaggregated leader (`knitjax.runtime.pipeline.Pipeline`) takes them from its rollout thread,
and a follower of a trainer spread over processes
(`knitjax.distributed.trainer_processes.FollowerPipe`) hears them from the leader. `run_steps`
drives any of them and holds, once, what follows each step: the metrics row, periodic
evaluation, the checkpoint with the pipe's run state, ``on_step``, and the plots at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax

from knitjax.config import Config
from knitjax.runtime import rollout_builder
from knitjax.runtime.evaluation import PeriodicEval, plot_eval
from knitjax.runtime.learner import Learner, RunState
from knitjax.runtime.metrics import MetricsWriter, mean_rows, plot_reward


class Pipe(Protocol):
  """One execution's side of the run loop: a train step's mini-batches and their bookkeeping."""

  def begin_step(self, step: int) -> None:
    """Train step ``step`` starts (colocated: its groups are generated here)."""

  def consume(self, step: int) -> list[dict]:
    """Applies the released mini-batches of ``step``, one optimizer update each; their rows."""

  def end_step(self, step: int, last: bool) -> dict:
    """The step's own metrics (clocks, flow, faults), after its last update.

    ``last``: no step follows, so whatever still runs beside the trainer stops first and the
    last step's metrics and checkpoint see the final state.
    """

  def snapshot(self) -> RunState:
    """The pipe's side of a checkpoint (the Learner adds version and staleness)."""

  def close(self) -> None:
    """Releases what the pipe holds; after a finished run, also writes what it measured."""


class Topology(Protocol):
  """Where a run's rollout, storage units, weight publisher and trainer processes are; the
  implementations, and the choice among them, are `knitjax.distributed`'s."""

  def split(self, devices: list) -> tuple[list, list]:
    """``(rollout devices, train devices)`` of this process for a disaggregated run (rollout
    devices empty: the rollout runs elsewhere and every device trains)."""

  def rollout(self, config: Config, graphdef, mesh, prompts):
    """The run's `knitjax.rollout.contract.Rollout` (its storage units in ``.storage``), or None
    in a process that has no rollout. ``mesh``: the devices that generate in this process."""

  def pipe(
    self, config: Config, workdir: str, learner, rollout, admission, prompts, train_mesh, resumed
  ):
    """A disaggregated run's `knitjax.runtime.loop.Pipe` in this process, weights published to
    where ``rollout`` generates."""

  def describe(self) -> str:
    """Where the rollout runs, for the run's first log line."""


def run_steps(
  config: Config,
  workdir: str,
  pipe: Pipe,
  learner: Learner,
  mesh: jax.sharding.Mesh,
  *,
  evals: PeriodicEval | None,
  on_step: Callable[[int, dict], None] | None = None,
  config_name: str | None = None,
) -> dict:
  """Runs the train steps from the learner's version to ``config.loop.steps`` over ``pipe``.

  Args:
    config: the validated run config.
    workdir: where ``metrics.jsonl``, TensorBoard files and plots go.
    pipe: the execution's step source; closed here, whether the run ends or fails.
    learner: the trainer; checkpointed after the steps the cadence names, then closed.
    mesh: the train mesh, where updates and evaluation run.
    evals: periodic held-out evaluation with the trainer's current parameters, or None.
    on_step: called after each train step with ``(step, metrics)``.
    config_name: the config's file and variant (``configs/arith_tiny.py:quick``), for the title
      of ``reward.png``.

  Returns:
    The last step's metrics.
  """
  start, total = learner.version // config.admission.minibatches, config.loop.steps
  writer = MetricsWriter(
    workdir,
    total_steps=total,
    start_step=start,
    log_every=config.loop.log_every,
    checkpoint_every=config.checkpoint.every_steps,
  )
  metrics: dict = {}
  try:
    with jax.set_mesh(mesh):
      if evals is not None and start == 0:
        evals.maybe_run(0, learner.policy_params, rollout_builder.eval_rng(config))
      for step in range(start, total):
        pipe.begin_step(step)
        rows = pipe.consume(step)
        own = pipe.end_step(step, last=step + 1 == total)
        metrics = {
          "version": learner.version,
          **mean_rows(rows),
          **learner.tracker.step_metrics(step),
          **own,
        }
        if evals is not None:
          metrics.update(
            evals.maybe_run(step + 1, learner.policy_params, rollout_builder.eval_rng(config))
          )
        writer.write(step + 1, metrics)
        learner.maybe_save(step + 1, total, pipe.snapshot)
        if on_step is not None:
          on_step(step + 1, metrics)
  finally:
    pipe.close()
    learner.close()
    writer.close()
  if writer.primary:
    plot_reward(workdir, config_name=config_name)
    plot_eval(workdir)
  return {"step": total, **metrics}
