"""The disaggregated pipeline around the trainer: the rollout side and each update's bookkeeping.

:class:`Pipeline` is the disaggregated leader's `knitjax.runtime.loop.Pipe`. It owns what runs
beside the trainer thread: the rollout thread and its released queue, the version clock
(pipeline depth) and weight sync, the trainer's feed, the ``consumed.jsonl`` / ``offered.jsonl``
logs, and the flow counters behind the step metrics. Each update it applies comes with
everything around it (order check, Learner, release, publish); its ``snapshot`` is the rollout
side of a checkpoint, taken under the rollout lock.

Groups lost with a storage unit (its node gone for good) are given up by the rollout thread
(`RolloutThread._lose`) and recorded once each in ``lost.jsonl``; a mini-batch the feed was
fetching from the lost unit is fetched again once refilled (see `ReleasedQueue.claim`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from knitjax import workdir as wd
from knitjax.rollout.versions import VersionClock
from knitjax.runtime import builder
from knitjax.runtime.learner import Learner, RunState
from knitjax.runtime.metrics import fault_counters
from knitjax.runtime.released import ReleasedQueue
from knitjax.runtime.rollout_thread import RolloutThread
from knitjax.runtime.weight_sync import WeightSync
from knitjax.transfer.feed import Prepared, exposed_transfer
from knitjax.transfer.snapshot import snapshot_groups
from knitjax.transfer.storage import release_groups

REFILL_WAIT_S = 600.0  # a reopened mini-batch not refilled by then stops the run
LOSS_WAIT_S = 120.0  # a fetch failed on a dead unit: how long the rollout has to declare it lost


def _jsonl_log(workdir: str, name: str, keep: Callable[[dict], bool]) -> wd.JsonlFile:
  """An append-only JSON-lines record, cut back on resume to the rows the checkpoint covers.

  Flushed (on a remote workdir: uploaded whole) when a checkpoint is taken, see ``snapshot``.
  """
  path = wd.path(workdir, name)
  rows = wd.read_rows(path)
  return wd.JsonlFile(path, [r for r in rows if keep(r)])


def _consumed_row(mb, version: int) -> dict:
  return {
    "step": mb.step,
    "index": mb.index,
    "consume_version": version,
    "group_ids": [g.group_id for g in mb.groups],
    "classes": [g.cls for g in mb.groups],
    "gen_versions": [g.gen_version for g in mb.groups],
    "t": time.time(),  # wall time the update that consumed it was done
  }


class Pipeline:
  """The rollout side of the run and the trainer's bookkeeping around each update.

  Holds the rollout thread, the released queue, the version clock and weight sync, the feed,
  the ``consumed.jsonl`` / ``offered.jsonl`` logs and the flow counters; ``snapshot`` is the
  rollout side of a checkpoint, consistent because it is taken under the rollout lock.

  The rollout thread and the feed start with the first step (after the evaluation before
  training); the thread stops when the last step ends, and a finished run's ``timings.json``
  is written when the pipeline closes.

  Args (beyond the parts it holds):
    train_mesh: the trainer's mesh; the feed's preparer (`builder.build_preparer`) places each
      mini-batch on it, planned by ``plans`` where the trainer spans processes.
    weights: the publisher the topology chose (`WeightSync` onto a rollout mesh in this process,
      `knitjax.distributed.weight_shards.ShardPublisher` to Ray rollout actors).
    plans, watch: a multi-process trainer's plan book, and its pulse watch, told when this
      process has finished.
    scale: polled before each train step (`knitjax.distributed.elastic.ScaleWatch`: a request
      for more or fewer Ray rollout workers), or None.
  """

  def __init__(
    self,
    config,
    workdir,
    learner: Learner,
    rollout,
    admission,
    prompts,
    resumed,
    *,
    train_mesh,
    weights,
    plans=None,
    watch=None,
    scale=None,
  ):
    restarts = 0 if resumed is None else resumed.restarts + 1
    resumed = resumed or RunState()
    self.config, self.workdir, self.learner, self.rollout = config, workdir, learner, rollout
    self.admission, self.prompts = admission, prompts
    self.consumed, self.restarts = resumed.consumed, restarts
    self.queue = ReleasedQueue(resumed.queued)
    self.lock = threading.Lock()
    stats0 = admission.stats()
    start_step = learner.version // config.admission.minibatches
    self._prepare = builder.build_preparer(
      config, rollout.storage, train_mesh, prompts, plan_for=plans.plan_for if plans else None
    )
    self._count = (config.loop.steps - start_step) * config.admission.minibatches
    # finished: the last step ended (a resumed run with no steps left has none to run).
    self.watch, self.feed, self.finished = watch, None, start_step >= config.loop.steps
    self.clock = VersionClock(
      learner.version,
      groups_per_step=config.admission.groups_per_step,
      minibatches=config.admission.minibatches,
      max_lag_steps=config.pipeline.max_lag_steps,
      lag_unit=config.pipeline.lag_unit,
    )
    self.weights = weights
    self.plans, self.scale = plans, scale
    # The first version is complete before the rollout starts, so it never idles waiting for it.
    self.weights.publish(learner.state.params, learner.version, block=True)
    # consumed.jsonl: one row per consumed mini-batch; offered.jsonl: one row per offered group.
    self.log = _jsonl_log(workdir, "consumed.jsonl", lambda r: r["step"] < start_step)
    self.offered = _jsonl_log(workdir, "offered.jsonl", lambda r: r["seq"] <= stats0["offered"])
    self._seq = stats0["offered"]
    # lost.jsonl: one row per group given up with its storage unit
    self.lost = _jsonl_log(workdir, "lost.jsonl", lambda r: r["seq"] <= stats0["lost"])
    self._lost_seq = stats0["lost"]
    self.thread = RolloutThread(
      rollout=rollout,
      prompts=prompts,
      admission=admission,
      queue=self.queue,
      clock=self.clock,
      weights=self.weights,
      lock=self.lock,
      next_group_id=resumed.next_group_id,
      accepted_started=stats0["offered"] - stats0["rejected"],
      restart=list(resumed.generating),
      rng=jax.random.fold_in(jax.random.key(config.seed), 1_000_003 * self.restarts + 1),
      on_offer=self._on_offer,
      on_lost=self._on_lost,
    )
    self.busy_s, self.idle_s, self.mb_seconds = 0.0, 0.0, []
    self.t_start = time.time()
    self._prev = _rollout_counters(self.thread, time.time())

  def _on_offer(self, meta, prompt, rejected: bool, started: float | None) -> None:
    self._seq += 1
    self.offered.write(
      {
        "seq": self._seq,
        "group_id": meta.group_id,
        "prompt_id": prompt.prompt_id,
        "cls": meta.cls,
        "storage_unit": meta.storage_unit,
        "gen_version": meta.gen_version,
        "rejected": bool(rejected),
        # Wall times (time.time()): the group started, its last sample done, offered here.
        "t_start": started,
        "t_complete": meta.completion_time,
        "t_offer": time.time(),
      }
    )

  def _on_lost(self, groups, where, units) -> None:
    for g, w in zip(groups, where, strict=True):
      self._lost_seq += 1
      self.lost.write(
        {
          "seq": self._lost_seq,
          "group_id": g.group_id,
          "storage_unit": g.storage_unit,
          "cls": g.cls,
          "where": w,  # pending in the admission index, or in a released mini-batch reopened
          "t": time.time(),
        }
      )
    logging.warning(
      "storage units %s are lost with their node: %d groups given up (%d pending, %d in "
      "released mini-batches, reopened), their prompts generated again (lost.jsonl).",
      sorted(units), len(groups), where.count("pending"), where.count("released"),
    )  # fmt: skip

  def _prepare_or_stale(self, mb):
    """The preparer, except that a mini-batch whose fetch failed because a unit of its groups
    was lost comes back without a batch (the trainer fetches it again once refilled)."""
    try:
      return self._prepare(mb)
    except Exception as e:
      if not _unit_gone(e):
        raise
      deadline = time.monotonic() + LOSS_WAIT_S
      while time.monotonic() < deadline and self.thread.is_alive():
        if self.queue.reopened(mb):
          return None, {}
        time.sleep(0.2)
      raise

  def _take(self, timeout: float):
    """The feed's source: the next released mini-batch, or an error if rollout is gone."""
    mb = self.queue.get(timeout=timeout)
    if mb is not None:
      if self.plans is not None:  # every trainer process hears it before this one fetches
        self.plans.announce(mb)
      return mb
    if self.thread.error is not None:
      raise RuntimeError(f"the rollout thread failed: {self.thread.error!r}") from self.thread.error
    if not self.thread.is_alive():
      raise RuntimeError("the rollout thread stopped before the trainer had its mini-batches.")
    return None

  def begin_step(self, step: int) -> None:
    if self.scale is not None:
      self.scale.poll()
    if self.feed is None:  # the first step: the rollout starts, then the feed that takes from it
      self.thread.start()
      self.feed = builder.build_feed(
        self.config, self._take, self._prepare_or_stale, count=self._count
      )
    self._t0, self._busy0, self._idle0 = time.time(), self.busy_s, self.idle_s
    self._w0 = publish_counters(self.weights)

  def consume(self, step: int) -> list[dict]:
    return [self._consume(step, j) for j in range(self.config.admission.minibatches)]

  def _consume(self, step: int, j: int) -> dict:
    """Takes mini-batch ``j`` of ``step`` from the feed, applies it, publishes, releases."""
    t_wait = time.perf_counter()
    p: Prepared = next(self.feed)
    mb = p.minibatch
    if (mb.step, mb.index) != (step, j):
      raise RuntimeError(f"released mini-batch {(mb.step, mb.index)} came before {(step, j)}.")
    while (got := self.queue.claim(mb, REFILL_WAIT_S)) is not mb or p.batch is None:
      if got is None:
        raise RuntimeError(
          f"mini-batch {(step, j)} lost groups with their storage unit and was not refilled "
          f"within {REFILL_WAIT_S:.0f} s; rerun to resume from the last checkpoint."
        )
      # reopened (groups lost with their unit) and refilled: fetched again, here
      t = time.perf_counter()
      batch, info = self._prepare_or_stale(got)
      mb, p = got, Prepared(got, batch, info, t, time.perf_counter(), time.perf_counter() - t)
    t_got = time.perf_counter()
    self.idle_s += t_got - t_wait
    row = self.learner.consume(p)
    if self.plans is not None:
      self.plans.record(p)
    version = self.learner.version
    released_at = self.queue.ack(mb)  # consumed: no longer part of a checkpoint's queue
    self.log.write(_consumed_row(mb, version - 1))
    self.consumed += len(mb.groups)
    self.thread.forget(g.group_id for g in mb.groups)
    self._release(mb.groups)
    if self.config.sync.every == "minibatch" or j == self.config.admission.minibatches - 1:
      self.weights.publish(self.learner.state.params, version)
    self.clock.advance(version)
    self.mb_seconds.append((time.time(), time.perf_counter() - t_got))
    self.busy_s += self.mb_seconds[-1][1]
    return {
      **row,
      **p.info,
      **exposed_transfer(p, t_wait, t_got),
      "release_to_compute_s": max(0.0, t_got - released_at),
    }

  def _release(self, groups) -> None:
    """Frees consumed groups' payloads; a unit lost with its node (its groups fetched before it
    was lost) has nothing to free."""
    storage = self.rollout.storage
    for unit in {g.storage_unit for g in groups} & set(storage):
      try:
        release_groups(storage, [g for g in groups if g.storage_unit == unit])
      except Exception as e:
        if not _unit_gone(e):
          raise
        logging.warning("storage unit %d did not answer a release (%s).", unit, type(e).__name__)

  def end_step(self, step: int, last: bool) -> dict:
    if last:
      self._stop()
      self.finished = True
    now = time.time()
    cur = _rollout_counters(self.thread, now)
    step_s = now - self._t0
    out = {
      "rollout_version": self.rollout.version,
      **_flow_metrics(
        self._prev, cur, step_s, self.busy_s - self._busy0, self.idle_s - self._idle0
      ),
      **_queue_metrics(
        self.admission, self.queue, self.thread, self.rollout, self.consumed, self.lock
      ),
      **publish_metrics(self._w0, publish_counters(self.weights)),
      "step_s": step_s,
      "wall_s": now - self.t_start,
    }
    self._prev = cur
    return out

  def snapshot(self) -> RunState:
    """The rollout side of a checkpoint (the Learner adds version and staleness).

    A unit that died with its node before the rollout thread found it gone fails the snapshot's
    reads: the snapshot is taken again once the loss is handled (its groups given up).
    """
    handled = self.thread.lost_units
    try:
      return self._snapshot()
    except Exception as e:
      if not _unit_gone(e):
        raise
      self._await_loss(handled)
      return self._snapshot()

  def _await_loss(self, handled: frozenset) -> None:
    deadline = time.monotonic() + LOSS_WAIT_S
    while self.thread.lost_units == handled and self.thread.is_alive():
      if time.monotonic() > deadline:
        raise RuntimeError(
          f"a storage unit stopped answering and was not found lost within {LOSS_WAIT_S:.0f} s; "
          "check the Ray cluster (`ray status`) and rerun to resume."
        )
      time.sleep(0.2)

  def _snapshot(self) -> RunState:
    self.log.flush()  # the logs hold at least what the checkpoint covers
    if self.plans is not None:
      self.plans.flush()
    deadline = time.monotonic() + REFILL_WAIT_S
    while True:  # a mini-batch being refilled is not checkpointed: wait until it is whole
      with self.lock:
        if not self.admission.refilling or time.monotonic() > deadline:
          return self._snapshot_locked()
      time.sleep(0.1)

  def _snapshot_locked(self) -> RunState:
    self.lost.flush()
    self.offered.flush()
    queued = tuple(self.queue.items())
    held = list(self.admission.pending()) + [g for mb in queued for g in mb.groups]
    return RunState(
      next_group_id=self.thread.next_group_id,
      prompts=self.prompts.state_dict(),
      admission=self.admission.state_dict(),
      consumed=self.consumed,
      queued=queued,
      payloads=snapshot_groups(self.rollout.storage, held),
      generating=tuple(self.thread.inflight_prompts()),
      restarts=self.restarts,
    )

  def _stop(self) -> None:
    self.clock.stop()
    if self.thread.is_alive():
      self.thread.join(timeout=60)

  def close(self) -> None:
    if self.watch is not None:  # first: the others may end (and the store with them) meanwhile
      self.watch.end(finished=self.finished)
    if self.feed is not None:
      self.feed.close()
    self._stop()
    self.weights.close()
    self.rollout.close()
    self.log.close()
    self.offered.close()
    self.lost.close()
    if self.plans is not None:
      self.plans.close()
    if self.finished:
      self._write_timings()

  def _write_timings(self) -> None:
    """``timings.json``: measured service times (the simulator's calibration) and lengths.

    ``calls``: per rollout call ``(end time, seconds, loop iterations, groups started, live
    samples, prefill chunk passes, decode passes)``; ``engine_calls``: the continuous engine's
    own call timeline (`ContinuousEngine.timeline`; empty for other rollouts);
    ``trainer_minibatch_s``: per mini-batch ``(end time, seconds)``, from taking it off the queue
    to publishing; times are ``time.time()``, ``t_start`` the trainer loop's start (``wall_s`` of
    metrics.jsonl counts from it).
    """
    calls = np.asarray(self.thread.calls, np.float64).reshape(-1, 7)
    engine = getattr(self.rollout, "engine", None)  # the continuous engine, when in process
    r = self.config.rollout
    out = {
      "t_start": self.t_start,
      "slots": r.slots,
      "shards": self.rollout.stats().shards,
      "decode_steps": r.decode_steps,
      "calls": calls.tolist(),
      "engine_calls": list(getattr(engine, "timeline", [])),
      "trainer_minibatch_s": self.mb_seconds,
      "weight_publish_s_mean": self.weights.publish_s / max(self.weights.published, 1),
      "weight_publish_bytes_mean": self.weights.published_bytes / max(self.weights.published, 1),
      "weight_publish_blocked_s_mean": self.weights.blocked_s / max(self.weights.published, 1),
      "weight_sync_dtype": self.weights.sync_dtype,
      "weight_sync_publish": self.weights.mode,
      "lengths": {c: list(v) for c, v in self.thread.lengths.items()},
      "restarts": self.restarts,
    }
    wd.path(self.workdir, "timings.json").write_text(json.dumps(out))


def _unit_gone(e: Exception) -> bool:
  """A unit gone from the rollout's mapping, or its Ray actor dead (its node lost)."""
  return isinstance(e, KeyError) or type(e).__module__.startswith("ray.")


def _unit_stats(storage) -> list[dict]:
  """The storage units' stats; a unit lost with its node (not yet dropped) is left out."""
  out = []
  for unit in list(storage.values()):
    try:
      out.append(unit.stats())
    except Exception as e:
      if not _unit_gone(e):
        raise
  return out


def _rollout_counters(rollout: RolloutThread, now: float) -> dict:
  stats = rollout.rollout.stats()
  return {
    "t": now,
    "busy_s": rollout.busy_s,
    "idle_s": rollout.idle_s,
    "tokens": stats.tokens,
    "iterations": stats.decode_iterations,
    "groups_started": rollout.groups_started,
  }


def publish_counters(w: WeightSync) -> tuple[int, float, float, int]:
  return w.published, w.publish_s, w.blocked_s, w.published_bytes


def publish_metrics(prev: tuple, cur: tuple) -> dict:
  """Per version completed during the step: seconds from dispatch until the rollout can adopt
  it, seconds the trainer's thread was held by the publish, and bytes on the wire."""
  n = max(cur[0] - prev[0], 1)
  return {
    "weight_publish_s": (cur[1] - prev[1]) / n,
    "weight_publish_blocked_s": (cur[2] - prev[2]) / n,
    "weight_publish_bytes": (cur[3] - prev[3]) / n,
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


def _queue_metrics(admission, queue, thread, rollout, consumed: int, lock) -> dict:
  with lock:
    s = admission.stats()
    queued = sum(len(mb.groups) for mb in queue.items(whole=True))  # reopened: the index's
  pending = s["pending"] + queued
  units = _unit_stats(rollout.storage)
  return {
    **fault_counters(rollout, units),
    "groups_offered": float(s["offered"]),
    "groups_consumed": float(consumed),
    "groups_rejected": float(s["rejected"]),
    "groups_pending": float(pending),
    # groups_lost: unaccounted for (must stay 0); groups_lost_with_node: given up, in lost.jsonl
    "groups_lost": float(s["offered"] - consumed - s["rejected"] - pending - s["lost"]),
    "groups_lost_with_node": float(s["lost"]),
    "queue_pending_groups": float(s["pending"]),
    "queue_waiting_groups": float(s["waiting"]),
    "queue_released_minibatches": float(len(queue)),
    "queue_generating_groups": float(thread.inflight_groups),
    "queue_storage_groups": float(sum(u["groups"] for u in units)),
    "queue_storage_bytes": float(sum(u["bytes"] for u in units)),
    "quota_violations": float(s["violations"]),
    "stalls": float(s["stalls"]),
  }
