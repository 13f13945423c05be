"""Disaggregated execution: rollout and trainer run at the same time on disjoint devices.

The first ``config.runtime.rollout_devices`` devices (half by default) form the rollout mesh,
the rest the train mesh. A `RolloutThread` generates with the continuous-batching engine and
feeds complete groups through the storage unit and the admission index; the trainer (this
thread) takes the released mini-batches in (step, index) order, applies one optimizer update
each, and publishes its weights after every mini-batch or every step (``runtime.weight_sync``)
by resharding them onto the rollout mesh. ``runtime.max_lag_steps`` bounds how far rollout
runs ahead (`knitjax.runtime.versions`). docs/disaggregated.md describes the design.

Checkpoints (every ``checkpoint.every_steps`` train steps) hold, besides the trainer state, a
consistent snapshot taken under the rollout's lock: the admission index (pending groups and
counters), the released mini-batches not yet consumed, the payloads of both
(`knitjax.runtime.snapshot`), the prompt streams, and the prompts of groups still generating,
which a resumed run regenerates first under new group ids. So after a kill nothing offered is
lost and nothing consumed is consumed again.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
from absl import logging

from knitjax import sharding
from knitjax.config import Config
from knitjax.runtime import builder
from knitjax.runtime.metrics import MetricsWriter, plot_reward
from knitjax.runtime.released import ReleasedQueue, minibatch_from_dict, minibatch_to_dict
from knitjax.runtime.rollout_thread import RolloutThread, prompt_from_dict, prompt_to_dict
from knitjax.runtime.snapshot import restore_groups, snapshot_groups
from knitjax.runtime.versions import VersionClock
from knitjax.runtime.weight_sync import WeightSync
from knitjax.tasks.rewards import get_reward_fn
from knitjax.train.checkpoint import Checkpointer
from knitjax.train.step import host_metrics
from knitjax.transfer.feed import OnDemandFeed, exposed_transfer
from knitjax.transfer.staleness import StalenessTracker


def split_devices(config: Config, devices=None) -> tuple[list, list]:
  """``(rollout devices, train devices)``: the first ``runtime.rollout_devices`` go to rollout."""
  devices = list(jax.devices() if devices is None else devices)
  r = config.runtime.rollout_devices or len(devices) // 2
  if not 1 <= r < len(devices):
    raise ValueError(
      f"config.runtime.rollout_devices={config.runtime.rollout_devices} leaves no devices for "
      f"one side of {len(devices)}; choose 1..{len(devices) - 1} (0: half)."
    )
  return devices[:r], devices[r:]


def _budgets(config: Config) -> dict[str, int]:
  r = config.rollout
  unknown = set(r.class_max_new_tokens) - set(config.admission.quotas)
  if unknown:
    raise ValueError(
      f"config.rollout.class_max_new_tokens names {sorted(unknown)}, which are not quota classes "
      f"{sorted(config.admission.quotas)}."
    )
  return {c: r.class_max_new_tokens.get(c, r.max_new_tokens) for c in config.admission.quotas}


class _JsonlLog:
  """An append-only JSON-lines record, cut back on resume to the rows the checkpoint covers."""

  def __init__(self, path: str, keep: Callable[[dict], bool]):
    self.path = path
    rows = []
    if os.path.exists(path):
      with open(path) as f:
        rows = [line for line in f if line.strip() and keep(json.loads(line))]
    with open(path, "w") as f:
      f.writelines(rows)
    self._file = open(path, "a")  # noqa: SIM115 (closed in close())

  def write(self, row: dict) -> None:
    self._file.write(json.dumps(row) + "\n")

  def flush(self) -> None:
    self._file.flush()

  def close(self) -> None:
    self._file.close()


def _consumed_row(mb, version: int) -> dict:
  return {
    "step": mb.step,
    "index": mb.index,
    "consume_version": version,
    "group_ids": [g.group_id for g in mb.groups],
    "classes": [g.cls for g in mb.groups],
    "gen_versions": [g.gen_version for g in mb.groups],
  }


def run(
  config: Config, workdir: str, *, on_step: Callable[[int, dict], None] | None = None
) -> dict:
  """Trains for ``config.runtime.steps`` train steps, resuming from ``workdir`` if possible.

  Args:
    config: the validated run config (``runtime.mode == "disaggregated"``).
    workdir: checkpoints, ``metrics.jsonl``, ``consumed.jsonl``, ``timings.json``, TensorBoard.
    on_step: called after each train step with ``(step, metrics)``.

  Returns:
    The last step's metrics.
  """
  rollout_devices, train_devices = split_devices(config)
  rollout_mesh = sharding.make_mesh((-1, 1, 1), devices=rollout_devices)
  train_mesh = builder.build_mesh(config, devices=train_devices)
  prompts = builder.build_prompts(config)
  budgets = _budgets(config)
  graphdef, state, _, train_step, ref = builder.init_state(config, train_mesh)
  storage = builder.build_storage(config, prompts)
  admission = builder.build_admission(config)
  tracker = StalenessTracker()
  queue = ReleasedQueue()
  ckpt = Checkpointer(workdir, keep=config.checkpoint.keep)
  m_per_step = config.admission.minibatches
  b_per_step = config.admission.groups_per_step
  version, next_group_id, consumed, restart, restarts = 0, 0, 0, [], 0
  if ckpt.latest_step() is not None:
    state, meta = ckpt.restore(state)
    version, next_group_id, consumed = meta["version"], meta["next_group_id"], meta["consumed"]
    prompts.load_state_dict(meta["prompts"])
    admission.load_state_dict(meta["admission"])
    tracker.load_state_dict(meta["staleness"])
    restore_groups(storage, meta["payloads"])
    queue = ReleasedQueue(minibatch_from_dict(d) for d in meta["queued"])
    restart = [prompt_from_dict(d) for d in meta["generating"]]
    restarts = meta["restarts"] + 1
  start_step = version // m_per_step
  total = config.runtime.steps
  stats0 = admission.stats()
  clock = VersionClock(
    version,
    groups_per_step=b_per_step,
    minibatches=m_per_step,
    max_lag_steps=config.runtime.max_lag_steps,
  )
  weights = WeightSync(sharding.state_shardings(state.params, rollout_mesh))
  weights.publish(state.params, version)
  lock = threading.Lock()
  # consumed.jsonl: one row per consumed mini-batch; offered.jsonl: one row per offered group.
  log = _JsonlLog(os.path.join(workdir, "consumed.jsonl"), lambda r: r["step"] < start_step)
  offered = _JsonlLog(
    os.path.join(workdir, "offered.jsonl"), lambda r: r["seq"] <= stats0["offered"]
  )

  seq = [stats0["offered"]]  # the index's offered counter, kept here (on_offer runs per group)

  def on_offer(meta, prompt, rejected: bool) -> None:
    seq[0] += 1
    offered.write(
      {
        "seq": seq[0],
        "group_id": meta.group_id,
        "prompt_id": prompt.prompt_id,
        "cls": meta.cls,
        "gen_version": meta.gen_version,
        "rejected": bool(rejected),
      }
    )

  rollout = RolloutThread(
    engine=builder.build_engine(config, graphdef, rollout_mesh, prompts),
    prompts=prompts,
    reward_fn=get_reward_fn(config.task.reward),
    group_size=config.rollout.group_size,
    budgets=budgets,
    storage=storage,
    admission=admission,
    queue=queue,
    clock=clock,
    weights=weights,
    lock=lock,
    next_group_id=next_group_id,
    accepted_started=stats0["offered"] - stats0["rejected"],
    restart=restart,
    rng=jax.random.fold_in(jax.random.key(config.seed), 1_000_003 * restarts + 1),
    on_offer=on_offer,
  )
  writer = MetricsWriter(
    workdir, total_steps=total, start_step=start_step, log_every=config.runtime.log_every
  )
  logging.info(
    "disaggregated: rollout on %d devices, training steps %d..%d on %d devices",
    len(rollout_devices),
    start_step + 1,
    total,
    len(train_devices),
  )
  feed = OnDemandFeed(
    _take_from(queue, rollout),
    builder.build_prepare(config, {storage.unit_id: storage}, train_mesh, prompts),
    count=(total - start_step) * m_per_step,
    prefetch=config.runtime.prefetch,
  )
  trainer_busy_s, trainer_idle_s, mb_seconds = 0.0, 0.0, []
  metrics: dict = {}
  t_start = time.time()
  prev = _rollout_counters(rollout, time.time())
  rollout.start()
  try:
    with jax.set_mesh(train_mesh):
      for step in range(start_step, total):
        t0 = time.time()
        busy0, idle0 = trainer_busy_s, trainer_idle_s
        step_metrics, infos = [], []
        for j in range(m_per_step):
          t_wait = time.perf_counter()
          p = next(feed)
          t_got = time.perf_counter()
          trainer_idle_s += t_got - t_wait
          mb, device_batch = p.minibatch, p.batch
          if (mb.step, mb.index) != (step, j):
            raise RuntimeError(
              f"released mini-batch {(mb.step, mb.index)} came before {(step, j)}."
            )
          args = (state, device_batch) if ref is None else (state, device_batch, ref)
          state, m = train_step(*args)
          step_metrics.append(host_metrics(m))  # waits for the update
          released_at = queue.ack(mb)  # consumed: no longer part of a checkpoint's queue
          info = {
            **p.info,
            **exposed_transfer(p, t_wait, t_got),
            "release_to_compute_s": max(0.0, t_got - released_at),
          }
          tracker.record(mb, consume_version=version)
          log.write(_consumed_row(mb, version))
          version += 1
          consumed += len(mb.groups)
          storage.release([g.group_id for g in mb.groups])
          infos.append(info)
          if config.runtime.weight_sync == "minibatch" or j == m_per_step - 1:
            weights.publish(state.params, version)
          clock.advance(version)
          mb_seconds.append((time.time(), time.perf_counter() - t_got))
          trainer_busy_s += mb_seconds[-1][1]
        if step + 1 == total:  # the last step's metrics and checkpoint see the final state
          clock.stop()
          rollout.join(timeout=60)
        now = time.time()
        cur = _rollout_counters(rollout, now)
        step_s = now - t0
        metrics = {
          "version": version,
          "rollout_version": rollout.engine.version,
          **{k: float(np.mean([m[k] for m in step_metrics])) for k in step_metrics[0]},
          **{k: float(np.mean([i[k] for i in infos])) for k in infos[0]},
          **tracker.step_metrics(step),
          **_flow_metrics(prev, cur, step_s, trainer_busy_s - busy0, trainer_idle_s - idle0),
          **_queue_metrics(admission, queue, rollout, storage, consumed, lock),
          "step_s": step_s,
          "wall_s": now - t_start,
        }
        prev = cur
        done = step + 1
        writer.write(done, metrics)
        if done % config.checkpoint.every_steps == 0 or done == total:
          log.flush()  # the logs hold at least what the checkpoint covers
          meta = _snapshot(admission, queue, rollout, storage, prompts, lock, offered)
          meta.update(
            version=version,
            consumed=consumed,
            staleness=tracker.state_dict(),
            restarts=restarts,
          )
          ckpt.save(done, state, meta)
        if on_step is not None:
          on_step(done, metrics)
  finally:
    feed.close()
    clock.stop()
    rollout.join(timeout=60)
    ckpt.close()
    writer.close()
    log.close()
    offered.close()
  _write_timings(workdir, rollout, mb_seconds, weights, config, restarts, t_start)
  if writer.primary:
    plot_reward(workdir)
  return {"step": total, **metrics}


def _take_from(queue: ReleasedQueue, rollout: RolloutThread):
  """The feed's source: the next released mini-batch, or an error if rollout is gone."""

  def take(timeout: float):
    mb = queue.get(timeout=timeout)
    if mb is not None:
      return mb
    if rollout.error is not None:
      raise RuntimeError(f"the rollout thread failed: {rollout.error!r}") from rollout.error
    if not rollout.is_alive():
      raise RuntimeError("the rollout thread stopped before the trainer had its mini-batches.")
    return None

  return take


def _rollout_counters(rollout: RolloutThread, now: float) -> dict:
  return {
    "t": now,
    "busy_s": rollout.busy_s,
    "idle_s": rollout.idle_s,
    "tokens": rollout.tokens,
    "iterations": rollout.engine.decode_iterations,
    "groups_started": rollout.groups_started,
  }


def _flow_metrics(prev: dict, cur: dict, step_s: float, t_busy: float, t_idle: float) -> dict:
  """Busy/idle fractions of both sides and throughput over one train step."""
  d = {k: cur[k] - prev[k] for k in cur}
  span = max(d["t"], 1e-9)
  slots_iters = d["iterations"] * 1.0
  return {
    "rollout_busy_fraction": min(1.0, d["busy_s"] / span),
    "rollout_idle_fraction": max(0.0, 1.0 - d["busy_s"] / span),
    "trainer_busy_fraction": min(1.0, t_busy / max(step_s, 1e-9)),
    "trainer_idle_fraction": min(1.0, t_idle / max(step_s, 1e-9)),
    "tokens_per_s": d["tokens"] / span,
    "decode_iterations": slots_iters,
    "groups_started": float(d["groups_started"]),
  }


def _queue_metrics(admission, queue, rollout, storage, consumed: int, lock) -> dict:
  with lock:
    s = admission.stats()
    queued = sum(len(mb.groups) for mb in queue.items())
  pending = s["pending"] + queued
  st = storage.stats()
  return {
    "groups_offered": float(s["offered"]),
    "groups_consumed": float(consumed),
    "groups_rejected": float(s["rejected"]),
    "groups_pending": float(pending),
    "groups_lost": float(s["offered"] - consumed - s["rejected"] - pending),
    "queue_pending_groups": float(s["pending"]),
    "queue_waiting_groups": float(s["waiting"]),
    "queue_released_minibatches": float(len(queue)),
    "queue_generating_groups": float(rollout.inflight_groups),
    "queue_storage_groups": float(st["groups"]),
    "queue_storage_bytes": float(st["bytes"]),
    "quota_violations": float(s["violations"]),
    "stalls": float(s["stalls"]),
  }


def _snapshot(admission, queue, rollout, storage, prompts, lock, offered_log) -> dict:
  """The rollout side of a checkpoint, consistent because it is taken under the rollout lock."""
  with lock:
    offered_log.flush()
    adm = admission.state_dict()
    queued = queue.items()
    ids = [g.group_id for g in admission.pending()] + [
      g.group_id for mb in queued for g in mb.groups
    ]
    return {
      "admission": adm,
      "queued": [minibatch_to_dict(mb) for mb in queued],
      "payloads": snapshot_groups(storage, ids),
      "prompts": prompts.state_dict(),
      "generating": [prompt_to_dict(p) for p in rollout.inflight_prompts()],
      "next_group_id": rollout.next_group_id,
    }


def _write_timings(workdir, rollout, mb_seconds, weights, config, restarts, t_start) -> None:
  """``timings.json``: measured service times (the simulator's calibration) and lengths.

  ``calls``: per engine call ``(end time, seconds, decode iterations, groups started, live
  samples)``; ``trainer_minibatch_s``: per mini-batch ``(end time, seconds)``, from taking it
  off the queue to publishing; times are ``time.time()``, ``t_start`` the trainer loop's start
  (``wall_s`` of metrics.jsonl counts from it).
  """
  calls = np.asarray(rollout.calls, np.float64).reshape(-1, 5)
  out = {
    "t_start": t_start,
    "slots": config.rollout.slots,
    "shards": rollout.engine.shards,
    "decode_steps": config.rollout.decode_steps,
    "calls": calls.tolist(),
    "trainer_minibatch_s": mb_seconds,
    "weight_publish_s_mean": weights.publish_s / max(weights.published, 1),
    "lengths": rollout.lengths,
    "restarts": restarts,
  }
  with open(os.path.join(workdir, "timings.json"), "w") as f:
    json.dump(out, f)
