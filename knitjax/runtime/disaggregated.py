"""Disaggregated execution: rollout and trainer run at the same time on disjoint devices.

The first ``config.topology.rollout_devices`` devices (half by default) form the rollout mesh,
the rest the train mesh. A `RolloutThread` drives the run's rollout (the one rollout contract:
continuous engine or batched sampler in process, or Ray actors) and feeds complete groups to the
admission index; the trainer (this thread) takes the released mini-batches in (step, index)
order through the on-demand feed, hands each to the Learner (one optimizer update), and
publishes its weights after every mini-batch or every step (``sync.every``) by
resharding them onto the rollout mesh. ``pipeline.max_lag_steps`` bounds how far rollout runs
ahead (`knitjax.rollout.versions`). docs/disaggregated.md describes the design.

Checkpoints (every ``checkpoint.every_steps`` train steps) hold, besides the trainer state, a
consistent snapshot taken under the rollout's lock (a `RunState`): the admission index (pending
groups and counters), the released mini-batches not yet consumed, the payloads of both
(`knitjax.transfer.snapshot`), the prompt streams, and the prompts of groups still generating,
which a resumed run regenerates first under new group ids. So after a kill nothing offered is
lost and nothing consumed is consumed again.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from absl import logging

from knitjax import sharding
from knitjax.config import Config
from knitjax.runtime import (
  builder,
  coordination,
  loop,
  rollout_builder,
  rollout_hosts,
  trainer_processes,
)
from knitjax.runtime.pipeline import Pipeline
from knitjax.transfer.snapshot import restore_groups
from knitjax.transfer.storage import release_groups


def split_devices(config: Config, devices=None) -> tuple[list, list]:
  """``(rollout devices, train devices)``: the first ``topology.rollout_devices`` go to rollout."""
  devices = list(jax.devices() if devices is None else devices)
  r = config.topology.rollout_devices or len(devices) // 2
  if not 1 <= r < len(devices):
    raise ValueError(
      f"config.topology.rollout_devices={config.topology.rollout_devices} leaves no devices for "
      f"one side of {len(devices)}; choose 1..{len(devices) - 1} (0: half)."
    )
  return devices[:r], devices[r:]


def _check_multiprocess(config: Config) -> None:
  """What a trainer spread over processes needs of the config (one sentence if not met)."""
  r = config.topology
  if not r.rollout_workers or r.rollout_hosts:
    raise ValueError(
      f"a disaggregated trainer of {jax.process_count()} processes takes its rollout from Ray "
      "workers: set config.topology.rollout_workers > 0 (rollout hosts and in-process rollout "
      "serve a one-process trainer)."
    )
  if config.transfer.mode != "on_demand":
    raise ValueError(
      f"config.transfer.mode={config.transfer.mode!r} gathers whole steps on one driver; a "
      "multi-process trainer fetches on demand (transfer.mode='on_demand')."
    )


def run(
  config: Config,
  workdir: str,
  *,
  on_step: Callable[[int, dict], None] | None = None,
  on_batch: Callable | None = None,
  config_name: str | None = None,
) -> dict:
  """Trains for ``config.loop.steps`` train steps, resuming from ``workdir`` if possible.

  Args:
    config: the validated run config (``topology.mode == "disaggregated"``).
    workdir: checkpoints, ``metrics.jsonl``, ``consumed.jsonl``, ``timings.json``, TensorBoard.
    on_step: called after each train step with ``(step, metrics)``.
    on_batch: a trainer of several processes calls it in each process with ``(mini-batch,
      train batch)`` for each mini-batch that process prepared.
    config_name: the config's file and variant (``configs/arith_tiny.py:quick``), for the title
      of ``reward.png``.

  Returns:
    The last step's metrics.
  """
  multiprocess = jax.process_count() > 1  # a trainer spread over processes (`trainer_processes`)
  leader = jax.process_index() == 0
  watch = None
  if multiprocess:
    _check_multiprocess(config)
    watch = coordination.PulseWatch()  # a trainer process lost ends the others (one sentence)
  hosts = config.topology.rollout_hosts
  if hosts or multiprocess:  # the rollout runs in other processes: every device here trains
    rollout_devices, train_devices = [], list(jax.devices())
  else:
    rollout_devices, train_devices = split_devices(config)
  train_mesh = builder.build_mesh(config, devices=train_devices)
  prompts = builder.build_prompts(config)
  graphdef, learner = builder.build_learner(
    config, train_mesh, workdir, prompt_len=prompts.prompt_len
  )
  rollout = admission = None
  if hosts:
    # Versions are staged on the train mesh; the hosts pull them from there.
    rollout_mesh = train_mesh
    rollout = rollout_hosts.remote_rollout(config, train_mesh, learner.state.params, workdir)
  elif leader:
    rollout_mesh = (
      train_mesh if multiprocess else sharding.make_mesh((-1, 1, 1), devices=rollout_devices)
    )
    rollout = rollout_builder.build_rollout(config, graphdef, rollout_mesh, prompts)
  if rollout is not None:
    admission = builder.build_admission(
      config, on_reject=lambda g: release_groups(rollout.storage, [g])
    )
  resumed = learner.restore()
  if resumed is not None and rollout is not None:
    prompts.load_state_dict(resumed.prompts)
    admission.load_state_dict(resumed.admission)
    if resumed.payloads is not None:
      restore_groups(rollout.storage, resumed.payloads)
  start = learner.version // config.admission.minibatches
  if multiprocess:
    pipe = trainer_processes.join(
      config,
      workdir,
      learner,
      prompts,
      train_mesh,
      rollout=rollout,
      admission=admission,
      resumed=resumed,
      watch=watch,
      on_batch=on_batch,
    )
  else:
    prepare = builder.build_preparer(config, rollout.storage, train_mesh, prompts)
    pipe = Pipeline(
      config,
      workdir,
      learner,
      rollout,
      admission,
      prompts,
      rollout_mesh,
      resumed,
      prepare=prepare,
    )
  logging.info(
    "disaggregated: rollout on %s, training steps %d..%d on %d devices",
    f"{hosts} rollout hosts"
    if hosts
    else f"{config.topology.rollout_workers} Ray workers"
    if multiprocess
    else f"{len(rollout_devices)} devices",
    start + 1,
    config.loop.steps,
    len(train_devices),
  )
  # Evaluation runs on the train mesh in this thread, with the trainer's current parameters.
  evals = rollout_builder.build_periodic_eval(config, graphdef, train_mesh, prompts, workdir, start)
  return loop.run_steps(
    config,
    workdir,
    pipe,
    learner,
    train_mesh,
    evals=evals,
    on_step=on_step,
    config_name=config_name,
  )
