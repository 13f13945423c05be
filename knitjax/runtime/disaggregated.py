"""Disaggregated execution: rollout and trainer run at the same time on disjoint devices.

Where the rollout runs is the topology's (`knitjax.distributed.topology`): on the first
``config.topology.rollout_devices`` devices of this process (half by default), or in Ray actors
while every device here trains, with one or several trainer processes. A `RolloutThread` drives
the run's rollout (the one rollout contract) and feeds complete groups to the admission index;
the trainer (this thread) takes the released mini-batches in (step, index) order through the
on-demand feed, hands each to the Learner (one optimizer update), and publishes its weights
after every mini-batch or every step (``sync.every``) through the topology's publisher.
``pipeline.max_lag_steps`` bounds how far rollout runs ahead (`knitjax.rollout.versions`).
docs/disaggregated.md describes the design.

Checkpoints (every ``checkpoint.every_steps`` train steps) hold, besides the trainer state, a
consistent snapshot taken under the rollout's lock (a `RunState`): the admission index (pending
groups and counters), the released mini-batches not yet consumed, the payloads of both
(`knitjax.transfer.snapshot`), the prompt streams, and the prompts of groups still generating,
which a resumed run regenerates first under new group ids. So after a kill nothing offered is
lost and nothing consumed is consumed again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from absl import logging

from knitjax import sharding
from knitjax.config import Config
from knitjax.runtime import builder, loop, rollout_builder
from knitjax.transfer.snapshot import restore_groups
from knitjax.transfer.storage import release_groups


def onto_units(resumed, units: list[int]):
  """``resumed`` with every group whose storage unit is not among ``units`` moved to the first
  of them: a Ray rollout scaled down before the checkpoint (`knitjax.distributed.elastic`) had
  units this process does not start. The payloads come from the snapshot either way; only
  where they are put back changes (the admission index's groups, the queued mini-batches and
  the snapshot, together)."""
  have = set(units)
  if not have:
    return resumed

  def fix(unit: int) -> int:
    return unit if unit in have else units[0]

  def group(g: dict) -> dict:
    return {**g, "storage_unit": fix(g["storage_unit"])} if "storage_unit" in g else g

  adm = dict(resumed.admission)
  if "open" in adm:
    adm["open"] = [group(g) for g in adm["open"]]
  if "waiting" in adm:
    adm["waiting"] = [[s, group(g)] for s, g in adm["waiting"]]
  queued = tuple(
    dataclasses.replace(
      mb,
      groups=tuple(dataclasses.replace(g, storage_unit=fix(g.storage_unit)) for g in mb.groups),
    )
    for mb in resumed.queued
  )
  payloads = resumed.payloads
  if payloads is not None and "groups" in payloads:
    payloads = {**payloads, "groups": [group(g) for g in payloads["groups"]]}
  moved = {
    g["storage_unit"] for g in (payloads or {}).get("groups", []) if g["storage_unit"] not in have
  }
  if moved:
    logging.info("groups of storage units %s (gone since the checkpoint) go to unit %d",
                 sorted(moved), units[0])  # fmt: skip
  return dataclasses.replace(resumed, admission=adm, queued=queued, payloads=payloads)


def run(
  config: Config,
  workdir: str,
  topology: loop.Topology,
  *,
  on_step: Callable[[int, dict], None] | None = None,
  on_batch: Callable | None = None,
  config_name: str | None = None,
) -> dict:
  """Trains for ``config.loop.steps`` train steps, resuming from ``workdir`` if possible.

  Args:
    config: the validated run config (``topology.mode == "disaggregated"``).
    workdir: checkpoints, ``metrics.jsonl``, ``consumed.jsonl``, ``timings.json``, TensorBoard.
    topology: where the rollout, its storage units and the trainer's processes are
      (`knitjax.distributed.topology.choose`).
    on_step: called after each train step with ``(step, metrics)``.
    on_batch: called with ``(mini-batch, train batch)`` before each update (`Learner`).
    config_name: the config's file and variant (``configs/arith_tiny.py:quick``), for the title
      of ``reward.png``.

  Returns:
    The last step's metrics.
  """
  rollout_devices, train_devices = topology.split(jax.devices())
  train_mesh = builder.build_mesh(config, devices=train_devices)
  rollout_mesh = (
    sharding.make_mesh((-1, 1, 1), devices=rollout_devices) if rollout_devices else None
  )
  prompts = builder.build_prompts(config)
  graphdef, learner = builder.build_learner(
    config, train_mesh, workdir, prompt_len=prompts.prompt_len, on_batch=on_batch
  )
  rollout = topology.rollout(config, graphdef, rollout_mesh, prompts)
  admission = None
  if rollout is not None:
    admission = builder.build_admission(
      config, on_reject=lambda g: release_groups(rollout.storage, [g])
    )
  resumed = learner.restore()
  if resumed is not None and rollout is not None:
    resumed = onto_units(resumed, sorted(rollout.storage))
    prompts.load_state_dict(resumed.prompts)
    admission.load_state_dict(resumed.admission)
    if resumed.payloads is not None:
      restore_groups(rollout.storage, resumed.payloads)
  start = learner.version // config.admission.minibatches
  pipe = topology.pipe(config, workdir, learner, rollout, admission, prompts, train_mesh, resumed)
  logging.info(
    "disaggregated: rollout on %s, training steps %d..%d on %d devices",
    topology.describe(),
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
