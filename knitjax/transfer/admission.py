"""Admission index: moves complete groups into mini-batches under a quota spec.

Three policies (docs/admission.md has the rule, a worked example and the definitions):

* ``minibatch`` (default): one open mini-batch, the earliest unreleased one. A group goes in iff
  the step can still be completed exactly afterwards (`feasibility.FeasibilityTracker`, exact and
  O(1) per check); otherwise it waits, FIFO, and is retried whenever the open mini-batch changes.
* ``train_batch`` (baseline): wait until the whole step's quotas are collected, then split them
  evenly into `M` mini-batches and release them all.
* ``greedy`` (ablation): first come, first placed; only the per-mini-batch max of the group's
  class is respected. Steps may end with wrong class counts: counted as violations, never hidden.

Groups lost with their storage unit (a node gone for good) are given up (`evict`): pending ones
leave the index and their quota slots reopen; a released mini-batch not yet consumed is reopened
(`reopen`) and its lost groups' places are filled by the next offered groups of the same classes
before anything else is admitted, so every mini-batch keeps its class counts.

Feasibility is monotone within one open mini-batch (a state on the way to a feasible state is
feasible), so a waiting class stays inadmissible until the open mini-batch changes: waiting
groups are kept per class, and only a release triggers a FIFO rescan of the class queues' heads.
"""

import collections
import dataclasses
import heapq
from collections.abc import Callable

from knitjax.transfer.admission_state import STATE_VERSION, check_state
from knitjax.transfer.feasibility import FeasibilityTracker, balanced_split
from knitjax.transfer.group import GroupIdSet, GroupMeta
from knitjax.transfer.quota import QuotaSpec

POLICIES = ("train_batch", "minibatch", "greedy")

_COUNTERS = (
  "offered",
  "admitted",
  "rejected",
  "released_minibatches",
  "released_groups",
  "released_steps",
  "quota_violations",
  "bound_violations",
  "stalls",
  "checks",
  "lost",
)


@dataclasses.dataclass(frozen=True)
class MiniBatch:
  """A released mini-batch: `index` (0-based) within train step `step`, groups in placed order."""

  step: int
  index: int
  groups: tuple[GroupMeta, ...]


class AdmissionIndex:
  """Quota-aware admission of complete groups into mini-batches (host-side, single-threaded)."""

  def __init__(
    self,
    spec: QuotaSpec,
    policy: str = "minibatch",
    *,
    dynamic_sampling: bool = False,
    on_reject: Callable[[GroupMeta], None] | None = None,
  ):
    """Creates an empty index at step 0, mini-batch 0.

    Args:
      spec: the quota spec every train step must meet.
      policy: one of `POLICIES`.
      dynamic_sampling: reject groups whose rewards have zero variance (``reward_std == 0``)
        before admission.
      on_reject: called with each rejected group, so the caller can free its payload.
    """
    if policy not in POLICIES:
      raise ValueError(f"AdmissionIndex policy={policy!r} is not one of {POLICIES}.")
    self.spec = spec
    self.policy = policy
    self.dynamic_sampling = dynamic_sampling
    self._on_reject = on_reject
    self._class_index = {c: i for i, c in enumerate(spec.classes)}
    self._quotas = [spec.class_quotas[c] for c in spec.classes]
    self._lows = [spec.min_of(c) for c in spec.classes]
    self._highs = [spec.max_of(c) for c in spec.classes]
    self._size = spec.groups_per_minibatch
    self._tracker = FeasibilityTracker(self._quotas, self._lows, self._highs, spec.minibatches)
    self._counters = dict.fromkeys(_COUNTERS, 0)
    self._seen = GroupIdSet()  # every group id ever offered (pending, released or rejected)
    self._reset(step=0, index=0, seq=0)

  # ---- public API -------------------------------------------------------------------------------

  @property
  def step(self) -> int:
    """The earliest unfinished train step."""
    return self._step

  @property
  def minibatch_index(self) -> int:
    """Index of the open mini-batch within `step`."""
    return self._index

  def offer(self, group: GroupMeta) -> list[MiniBatch]:
    """Offers one complete group; returns the mini-batches it released, in (step, index) order.

    Raises:
      ValueError: the group's class is not in the spec, or its id was offered before (pending,
        released or rejected); the index is unchanged.
    """
    if not isinstance(group, GroupMeta):
      raise ValueError(f"offer takes a GroupMeta, got {type(group).__name__}.")
    c = self._class_index.get(group.cls)
    if c is None:
      raise ValueError(
        f"group {group.group_id} has class {group.cls!r}, which the quota spec does not name "
        f"(classes: {list(self.spec.classes)})."
      )
    if not self._seen.add(group.group_id):
      where = "still pending" if group.group_id in self._pending_ids else "released or rejected"
      raise ValueError(
        f"group {group.group_id} was already offered to this index ({where}); "
        "every group id is accepted once."
      )
    self._counters["offered"] += 1
    if self.dynamic_sampling and group.reward_std == 0:
      self._counters["rejected"] += 1
      if self._on_reject is not None:
        self._on_reject(group)
      return []
    self._pending_ids.add(group.group_id)
    entry = (self._seq, group)
    self._seq += 1
    released: list[MiniBatch] = []
    if self._fill_hole(group, released):
      return released
    if self.policy == "train_batch":
      self._wait(c, entry)
      while self._short == 0:
        self._release_step(released)
    elif not self._waiting[c] and self._admissible(c):
      self._place(c, group, released)
    else:
      self._wait(c, entry)
    self._note_stall()
    return released

  def evict(self, units) -> tuple[list[GroupMeta], list[MiniBatch]]:
    """Gives up the pending groups held by storage units ``units`` (lost with their node).

    Their quota slots reopen: a group leaves the open mini-batch or its class queue, and the
    step's placed count drops with it. Taking a group out of the open mini-batch keeps the step
    completable (the state before it was placed led to a feasible one), and the open mini-batch
    changed, so waiting groups are rescanned and may release mini-batches. Groups filling a
    reopened mini-batch (`reopen`) that are lost leave their place open again.

    Returns:
      The lost groups (counted in ``stats()["lost"]``), and the mini-batches released meanwhile.
    """
    units = set(units)
    lost = [g for g in self._open if g.storage_unit in units]
    for g in lost:
      c = self._class_index[g.cls]
      self._open_counts[c] -= 1
      self._placed[c] -= 1
    self._open = [g for g in self._open if g.storage_unit not in units]
    for c, q in enumerate(self._waiting):
      lost += [g for _, g in q if g.storage_unit in units]
      self._waiting[c] = collections.deque(e for e in q if e[1].storage_unit not in units)
    for g in lost:
      self._pending_ids.discard(g.group_id)
    lost += self._evict_holes(units)
    self._tracker.set_state(
      self._open_counts,
      [q - p for q, p in zip(self._quotas, self._placed, strict=True)],
      self.spec.minibatches - 1 - self._index,
    )
    self._short = sum(self._is_short(c) for c in range(len(self._quotas)))
    self._stalled = False
    self._counters["lost"] += len(lost)
    released: list[MiniBatch] = []
    if lost and self.policy != "train_batch":
      self._rescan(released)
    self._note_stall()
    return lost, released

  def reopen(self, minibatch: MiniBatch, lost_ids) -> None:
    """Reopens a released, unconsumed mini-batch whose groups ``lost_ids`` were lost with their
    storage unit: the next offered groups of the lost groups' classes take their places (before
    any admission), and the refilled mini-batch is released again (same step and index, same
    class counts) by the `offer` that completes it. The lost groups count in ``stats()["lost"]``.

    Raises:
      ValueError: ``lost_ids`` names no group of the mini-batch.
    """
    lost_ids = set(lost_ids)
    slots = [i for i, g in enumerate(minibatch.groups) if g.group_id in lost_ids]
    if not slots or len(slots) != len(lost_ids):
      raise ValueError(
        f"reopen: groups {sorted(lost_ids)} are not all in mini-batch "
        f"{(minibatch.step, minibatch.index)}."
      )
    self._holes.append([minibatch.step, minibatch.index, list(minibatch.groups), slots])
    self._counters["lost"] += len(slots)

  @property
  def refilling(self) -> list[tuple[int, int]]:
    """(step, index) of the reopened mini-batches still waiting for groups, oldest first."""
    return [(h[0], h[1]) for h in self._holes]

  def open_groups(self) -> tuple[GroupMeta, ...]:
    """Groups placed in the open mini-batch (not released yet), in placed order."""
    return tuple(self._open)

  def waiting(self) -> list[GroupMeta]:
    """Pending groups not placed in any mini-batch yet, in arrival (FIFO) order."""
    return [g for _, g in sorted(e for q in self._waiting for e in q)]

  def pending(self) -> list[GroupMeta]:
    """Every group the index holds unreleased: placed in the open mini-batch, waiting FIFO, then
    held in reopened mini-batches (see `reopen`)."""
    return list(self._open) + self.waiting() + self._held_in_holes()

  def stats(self) -> dict:
    """Counters (cumulative) and the current backlog.

    Keys: ``offered``, ``admitted`` (placed into a mini-batch), ``rejected`` (dynamic sampling),
    ``released_minibatches``, ``released_groups``, ``released_steps``, ``quota_violations``
    (released steps whose class counts differ from the quotas), ``bound_violations`` (released
    mini-batches with a class outside its min/max), ``violations`` (their sum), ``stalls``
    (mini-batches that stalled, see docs/admission.md), ``checks`` (admissibility checks made),
    ``lost`` (given up with their storage unit: `evict`, `reopen`), ``pending`` (held
    unreleased, reopened mini-batches' groups included) and ``pending_per_class`` (open and
    waiting only), ``waiting`` (pending, not yet placed), ``step``, ``minibatch_index``.
    """
    pending_per_class = {c: len(q) for c, q in zip(self.spec.classes, self._waiting, strict=True)}
    for g in self._open:
      pending_per_class[g.cls] += 1
    out = dict(self._counters)
    out["violations"] = out["quota_violations"] + out["bound_violations"]
    out["pending"] = sum(pending_per_class.values()) + len(self._held_in_holes())
    out["pending_per_class"] = pending_per_class
    out["waiting"] = sum(len(q) for q in self._waiting)
    out["step"] = self._step
    out["minibatch_index"] = self._index
    return out

  def remaining(self, horizon_steps: int = 1) -> dict[str, int]:
    """Per class, groups still needed by the earliest `horizon_steps` unfinished steps.

    Counts what those steps need beyond the groups already placed or waiting (never below 0),
    for admission-aware rollout scheduling.
    """
    if horizon_steps < 1:
      raise ValueError(f"remaining horizon_steps={horizon_steps!r} must be >= 1.")
    out = {}
    for c, name in enumerate(self.spec.classes):
      need = max(0, self._quotas[c] - self._placed[c]) + (horizon_steps - 1) * self._quotas[c]
      out[name] = max(0, need - len(self._waiting[c]))
    return out

  def state_dict(self) -> dict:
    """Plain-Python checkpoint of the whole index, pending groups and seen group ids included.

    Raises:
      RuntimeError: a reopened mini-batch is still waiting for groups (not checkpointed: take
        the checkpoint once `refilling` is empty).
    """
    if self._holes:
      raise RuntimeError(
        f"admission state: reopened mini-batches {self.refilling} are still being refilled."
      )
    waiting = sorted(e for q in self._waiting for e in q)
    return {
      "version": STATE_VERSION,
      "policy": self.policy,
      "spec": self.spec.to_dict(),
      "dynamic_sampling": self.dynamic_sampling,
      "step": self._step,
      "index": self._index,
      "seq": self._seq,
      "placed": dict(zip(self.spec.classes, self._placed, strict=True)),
      "open": [g.to_dict() for g in self._open],
      "waiting": [[s, g.to_dict()] for s, g in waiting],
      "stalled": self._stalled,
      "counters": dict(self._counters),
      "seen": self._seen.ranges(),
    }

  def load_state_dict(self, state: dict) -> None:
    """Restores a `state_dict` taken from an index with the same spec and policy.

    The whole state is checked before anything changes: a `ValueError` names the first problem
    and leaves the index as it was.
    """
    if isinstance(state, dict) and isinstance(state.get("counters"), dict):
      state = {**state, "counters": {"lost": 0, **state["counters"]}}  # saved before "lost"
    checked = check_state(state, spec=self.spec, policy=self.policy, counter_names=_COUNTERS)
    self._reset(step=checked.step, index=checked.index, seq=checked.seq)
    self._placed = checked.placed
    self._open = checked.open_groups
    counts = [0] * len(self._quotas)
    for g in checked.open_groups:
      counts[self._class_index[g.cls]] += 1
      self._pending_ids.add(g.group_id)
    for s, g in checked.waiting:
      self._waiting[self._class_index[g.cls]].append((s, g))
      self._pending_ids.add(g.group_id)
    remaining = [q - p for q, p in zip(self._quotas, checked.placed, strict=True)]
    self._tracker.set_state(counts, remaining, self.spec.minibatches - 1 - checked.index)
    self._open_counts = counts
    self._short = sum(self._is_short(c) for c in range(len(self._quotas)))
    self._stalled = checked.stalled
    self._counters = checked.counters
    self._seen = checked.seen

  # ---- internals --------------------------------------------------------------------------------

  def _fill_hole(self, group: GroupMeta, released: list[MiniBatch]) -> bool:
    """Puts ``group`` into the oldest open place of its class in a reopened mini-batch."""
    for hole in self._holes:
      step, index, groups, slots = hole
      slot = next((i for i in slots if groups[i].cls == group.cls), None)
      if slot is None:
        continue
      groups[slot] = group
      slots.remove(slot)
      self._counters["admitted"] += 1
      if not slots:
        self._holes.remove(hole)
        for g in groups:
          self._pending_ids.discard(g.group_id)
        released.append(MiniBatch(step, index, tuple(groups)))
      return True
    return False

  def _held_in_holes(self) -> list[GroupMeta]:
    return [
      g for _, _, groups, slots in self._holes for i, g in enumerate(groups) if i not in slots
    ]

  def _evict_holes(self, units: set) -> list[GroupMeta]:
    """Groups held in reopened mini-batches that are lost too: their places open again."""
    lost = []
    for _, _, groups, slots in self._holes:
      for i, g in enumerate(groups):
        if i not in slots and g.storage_unit in units:
          lost.append(g)
          slots.append(i)
          self._pending_ids.discard(g.group_id)
    return lost

  def _reset(self, *, step: int, index: int, seq: int) -> None:
    n = len(self._quotas)
    self._step, self._index, self._seq = step, index, seq
    self._waiting: list[collections.deque] = [collections.deque() for _ in range(n)]
    self._open: list[GroupMeta] = []
    self._open_counts = [0] * n
    self._placed = [0] * n  # groups of each class placed in the current step (open included)
    self._pending_ids: set[int] = set()
    self._short = n  # classes whose waiting groups do not cover the step's remaining quota
    self._stalled = False  # whether the open mini-batch has been counted as stalled
    # reopened mini-batches: [step, index, groups, open places (indices into groups)]
    self._holes: list[list] = []
    self._tracker.start_step()

  def _is_short(self, c: int) -> bool:
    return len(self._waiting[c]) < self._quotas[c] - self._placed[c]

  def _wait(self, c: int, entry: tuple[int, GroupMeta]) -> None:
    was_short = self._is_short(c)
    self._waiting[c].append(entry)
    self._short -= was_short and not self._is_short(c)

  def _admissible(self, c: int) -> bool:
    self._counters["checks"] += 1
    if self.policy == "minibatch":
      return self._tracker.can_place(c)
    return self._open_counts[c] < self._highs[c]  # greedy: the local max bound only

  def _place(self, c: int, group: GroupMeta, released: list[MiniBatch]) -> None:
    """Places `group` into the open mini-batch; on a full one, releases and rescans."""
    was_short = self._is_short(c)
    self._open.append(group)
    self._open_counts[c] += 1
    self._placed[c] += 1
    self._tracker.place(c)
    self._short += self._is_short(c) - was_short
    self._counters["admitted"] += 1
    if len(self._open) == self._size:
      self._release_open(released)
      self._rescan(released)

  def _rescan(self, released: list[MiniBatch]) -> None:
    # FIFO over all waiting groups: the earliest head among admissible classes goes first. A class
    # found inadmissible stays so until the open mini-batch changes (monotonicity), so drop it.
    while True:
      heads = [(q[0][0], c) for c, q in enumerate(self._waiting) if q]
      heapq.heapify(heads)
      index_before = (self._step, self._index)
      while heads:
        _, c = heapq.heappop(heads)
        if not self._admissible(c):
          continue
        _, group = self._waiting[c].popleft()
        self._place_waiting(c, group, released)
        if (self._step, self._index) != index_before:
          break  # a release happened: start over with the new open mini-batch
        if self._waiting[c]:
          heapq.heappush(heads, (self._waiting[c][0][0], c))
      else:
        return

  def _place_waiting(self, c: int, group: GroupMeta, released: list[MiniBatch]) -> None:
    # Like _place, but the group leaves the waiting queue (already popped) and no nested rescan.
    self._open.append(group)
    self._open_counts[c] += 1
    self._placed[c] += 1
    self._tracker.place(c)  # waiting and remaining quota both drop by one: shortness unchanged
    self._counters["admitted"] += 1
    if len(self._open) == self._size:
      self._release_open(released)

  def _release_open(self, released: list[MiniBatch]) -> None:
    self._emit(self._open, self._open_counts, released)
    self._open, self._open_counts = [], [0] * len(self._quotas)
    self._stalled = False
    if self._index + 1 < self.spec.minibatches:
      self._index += 1
      self._tracker.next_minibatch()
      return
    self._finish_step()

  def _release_step(self, released: list[MiniBatch]) -> None:
    """train_batch: takes each class's quota from its queue (FIFO) and releases all M."""
    split = balanced_split(self._quotas, self.spec.minibatches)
    taken = [[self._waiting[c].popleft()[1] for _ in range(q)] for c, q in enumerate(self._quotas)]
    cursor = [0] * len(self._quotas)
    for j, counts in enumerate(split):
      self._index = j
      groups = []
      for c, n in enumerate(counts):
        groups += taken[c][cursor[c] : cursor[c] + n]
        cursor[c] += n
      self._counters["admitted"] += len(groups)
      self._emit(groups, counts, released)
    self._placed = list(self._quotas)
    self._finish_step()

  def _emit(self, groups: list[GroupMeta], counts: list[int], released: list[MiniBatch]) -> None:
    """Releases `groups` (class counts `counts`) as the mini-batch at (step, index)."""
    if any(not lo <= n <= hi for lo, n, hi in zip(self._lows, counts, self._highs, strict=True)):
      self._counters["bound_violations"] += 1
    for g in groups:
      self._pending_ids.discard(g.group_id)
    released.append(MiniBatch(self._step, self._index, tuple(groups)))
    self._counters["released_minibatches"] += 1
    self._counters["released_groups"] += len(groups)

  def _finish_step(self) -> None:
    if self._placed != self._quotas:
      self._counters["quota_violations"] += 1
    self._counters["released_steps"] += 1
    self._step += 1
    self._index = 0
    self._placed = [0] * len(self._quotas)
    self._stalled = False
    self._tracker.start_step()
    self._short = sum(self._is_short(c) for c in range(len(self._quotas)))

  def _note_stall(self) -> None:
    # Stalled: groups wait, none fits the open mini-batch (true of every waiting group here, by
    # construction), yet they cover the step's remaining quota of every class. Counted once per
    # mini-batch.
    if self._stalled or self._short or not any(self._waiting):
      return
    self._stalled = True
    self._counters["stalls"] += 1
