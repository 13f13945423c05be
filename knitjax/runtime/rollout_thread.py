"""The rollout side of disaggregated execution: a thread that keeps any rollout busy.

It drives a :class:`~knitjax.rollout.contract.Rollout` (batched sampler, continuous engine, or
Ray actors): adopts each newly published policy version, starts groups (prompts from the
per-class streams in quota proportion) while the depth bound allows and the rollout has room,
and offers every complete group to the admission index; what the index releases goes to the
trainer's queue. The rollout has already written the payloads into its storage units; a group
that dynamic sampling rejects is released there by the index's ``on_reject``.

One lock (``lock``) makes "offer a group, queue what it released" atomic with respect to the
trainer's checkpoint snapshot, so a checkpoint always sees every offered group exactly once:
pending in the index, queued, or consumed. Generation and storage puts happen outside it, as
puts may wait for room (backpressure) until the trainer releases consumed groups.

A storage unit lost with its node (``RolloutStats.lost_units``) loses the groups it held: under
the same lock they are given up (`AdmissionIndex.evict`; released mini-batches not yet claimed
by the trainer are reopened), each reported once to ``on_lost``, and their prompts start again
first, on the workers left; the depth bound counts them as never started.
"""

from __future__ import annotations

import collections
import threading
import time

import jax

from knitjax import faultpoints
from knitjax.rollout.contract import Rollout
from knitjax.rollout.scheduling import PlainScheduler
from knitjax.rollout.versions import VersionClock
from knitjax.runtime.released import ReleasedQueue
from knitjax.runtime.weight_sync import WeightSync
from knitjax.tasks.prompts import Prompt
from knitjax.tasks.streams import ClassStreams
from knitjax.transfer.admission import AdmissionIndex

_IDLE_WAIT_S = 0.5
HISTORY_ROWS = 200_000  # rollout calls and response lengths per class kept (the newest)


class RolloutThread:
  """Generates complete groups concurrently with training (see the module docstring).

  Args:
    rollout: what generates (any implementation of the rollout contract).
    prompts: the per-class prompt streams.
    admission: the admission index (shared with the trainer's checkpoints, under ``lock``).
    queue: where released mini-batches go.
    clock: the trainer's version and the depth bound.
    weights: published policy versions.
    lock: guards the index, the queue pushes, the prompt streams and the group counter.
    next_group_id: first group id to hand out.
    accepted_started: groups started so far minus rejected ones (the depth bound counts them).
    restart: prompts of groups that were generating at the checkpoint; they start first.
    rng: base key of the rollout's draws.
    on_offer: called under ``lock`` after each offer with ``(group meta, prompt, rejected,
      started)``, ``started`` the wall time (``time.time()``) the group was started.
    on_lost: called under ``lock`` with the groups given up when storage units are lost, and
      where each was (``"pending"`` in the index, ``"released"`` in a reopened mini-batch).
  """

  def __init__(
    self,
    *,
    rollout: Rollout,
    prompts: ClassStreams,
    admission: AdmissionIndex,
    queue: ReleasedQueue,
    clock: VersionClock,
    weights: WeightSync,
    lock: threading.Lock,
    next_group_id: int,
    accepted_started: int,
    restart: list[Prompt] = (),
    rng: jax.Array,
    on_offer=None,
    on_lost=None,
  ):
    self.rollout, self.prompts = rollout, prompts
    self.admission, self.queue = admission, queue
    self.clock, self.weights, self.lock = clock, weights, lock
    self.next_group_id = next_group_id
    self.accepted_started = accepted_started
    self._restart = collections.deque(restart)
    self._rng = rng
    self._on_offer, self._on_lost = on_offer, on_lost
    self._prompt_of: dict[int, Prompt] = {}  # offered, not consumed: regenerated if lost
    self._lost_units: set[int] = set(rollout.stats().lost_units)
    classes = list(admission.spec.classes)
    self._classes = classes
    self._scheduler = PlainScheduler([admission.spec.class_quotas[c] for c in classes])
    self._inflight: dict[int, Prompt] = {}
    self._started_at: dict[int, float] = {}  # wall time each generating group was started
    self._thread = threading.Thread(target=self._main, name="rollout", daemon=True)
    self.error: BaseException | None = None
    # Counters read by the trainer for metrics (plain numbers: one writer, GIL-atomic reads).
    self.busy_s = 0.0
    self.idle_s = 0.0
    self.groups_started = 0
    self.groups_completed = 0
    # Per rollout call: (end time, seconds, decode iterations, groups started, live samples
    # before, prefill chunk passes, decode passes), and each class's response lengths: the
    # newest HISTORY_ROWS of each (bounded memory in long runs; the calibration reads a window).
    self.calls: collections.deque[tuple] = collections.deque(maxlen=HISTORY_ROWS)
    self.lengths = {c: collections.deque(maxlen=HISTORY_ROWS) for c in classes}

  # ---- control ------------------------------------------------------------------------------

  def start(self) -> None:
    self._thread.start()

  def join(self, timeout: float | None = None) -> None:
    self._thread.join(timeout)

  def is_alive(self) -> bool:
    return self._thread.is_alive()

  @property
  def inflight_groups(self) -> int:
    return len(self._inflight)

  def inflight_prompts(self) -> list[Prompt]:
    """Prompts of the groups generating now, oldest first (call under ``lock``)."""
    return [p for _, p in sorted(self._inflight.items())] + list(self._restart)

  # ---- loop ---------------------------------------------------------------------------------

  def _main(self) -> None:
    try:
      self._loop()
    except BaseException as e:  # surfaced by the trainer, which then stops
      self.error = e
      self.clock.stop()

  def _loop(self) -> None:
    rollout = self.rollout
    call = 0
    while not self.clock.stopped:
      t0 = time.perf_counter()
      seen = self.clock.version
      if rollout.version is not None and seen > rollout.version:
        # An asynchronous publish lets the clock run ahead of the adoptable weights: take the
        # copy in flight before starting groups, so none starts on weights older than the
        # depth bound assumes (the order a blocking publish gave).
        self.weights.wait()
      newer = self.weights.take_newer(rollout.version)
      if newer is not None:
        rollout.adopt(newer[1], newer[0])
      limit = self.clock.limit(rollout.version)  # groups start on the adopted weights
      started = 0
      while (
        rollout.version is not None and self.accepted_started < limit and rollout.capacity() > 0
      ):
        self._start_group()
        started += 1
      if not rollout.inflight:
        self.clock.wait(seen, _IDLE_WAIT_S)  # nothing to do until the trainer moves on
        self.idle_s += time.perf_counter() - t0
        continue
      before = rollout.stats()
      metas = rollout.step(
        jax.random.fold_in(self._rng, call), want_room=self.accepted_started < limit
      )
      call += 1
      if metas:
        faultpoints.point("rollout")
      for meta in metas:
        self._offer(meta)
      if lost := set(rollout.stats().lost_units) - self._lost_units:
        self._lose(lost)
      dt = time.perf_counter() - t0
      self.busy_s += dt
      after = rollout.stats()
      self.calls.append(
        (
          time.time(),
          dt,
          after.decode_iterations - before.decode_iterations,
          started,
          before.live_samples,
          after.chunk_passes - before.chunk_passes,
          after.decode_passes - before.decode_passes,
        )
      )

  def _start_group(self) -> None:
    with self.lock:
      if self._restart:
        prompt = self._restart.popleft()
      else:
        cls = self._classes[self._scheduler.next_class()]
        prompt = self.prompts.next({cls: 1})[0]
      gid = self.next_group_id
      self.next_group_id += 1
      self._inflight[gid] = prompt
      self._started_at[gid] = time.time()
    self.rollout.start(prompt, gid)
    self.accepted_started += 1
    self.groups_started += 1

  def _offer(self, meta) -> None:
    self.lengths[meta.cls].extend(meta.response_tokens)
    rejected = self.admission.dynamic_sampling and meta.reward_std == 0
    with self.lock:
      prompt = self._inflight.pop(meta.group_id)
      started = self._started_at.pop(meta.group_id, None)
      for mb in self.admission.offer(meta):  # a rejected group is released by on_reject
        self._put(mb)
      if not rejected:
        self._prompt_of[meta.group_id] = prompt
      if self._on_offer is not None:
        self._on_offer(meta, prompt, rejected, started)
      faultpoints.point("admission")
    self.groups_completed += 1
    self.accepted_started -= rejected

  def _put(self, mb) -> None:
    if self.queue.reopened(mb):  # a reopened mini-batch, refilled: back in its place
      self.queue.refill(mb)
    else:
      self.queue.put(mb)

  @property
  def lost_units(self) -> frozenset[int]:
    """Storage units whose loss has been handled (their groups given up)."""
    return frozenset(self._lost_units)

  def forget(self, group_ids) -> None:
    """The groups were consumed: their prompts are not needed again."""
    for gid in group_ids:
      self._prompt_of.pop(gid, None)

  def _lose(self, units: set[int]) -> None:
    """Gives up every group the lost ``units`` held that the trainer has not claimed."""
    with self.lock:
      lost, released = self.admission.evict(units)
      where = ["pending"] * len(lost)
      for mb in self.queue.items(whole=True):
        ids = [g.group_id for g in mb.groups if g.storage_unit in units]
        if ids and self.queue.reopen(mb):
          self.admission.reopen(mb, ids)
          lost += [g for g in mb.groups if g.group_id in ids]
          where += ["released"] * len(ids)
      for mb in released:
        self._put(mb)
      # the same prompts start again first (a fresh one of the class if not known: resumed)
      prompts = [
        self._prompt_of.pop(g.group_id, None) or self.prompts.next({g.cls: 1})[0] for g in lost
      ]
      self._restart.extendleft(reversed(prompts))
      if self._on_lost is not None:
        self._on_lost(lost, where, units)
    self._lost_units |= units
    self.accepted_started -= len(lost)
