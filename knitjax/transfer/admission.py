"""Admission index: moves complete groups into mini-batches under a quota spec.

Three policies (docs/admission.md has the rule, a worked example and the definitions):

* ``minibatch`` (default): one open mini-batch, the earliest unreleased one. A group goes in iff
  the step can still be completed exactly afterwards (`feasibility.FeasibilityTracker`, exact and
  O(1) per check); otherwise it waits, FIFO, and is retried whenever the open mini-batch changes.
* ``train_batch`` (baseline): wait until the whole step's quotas are collected, then split them
  evenly into `M` mini-batches and release them all.
* ``greedy`` (ablation): first come, first placed; only the per-mini-batch max of the group's
  class is respected. Steps may end with wrong class counts: counted as violations, never hidden.

Feasibility is monotone within one open mini-batch (a state on the way to a feasible state is
feasible), so a waiting class stays inadmissible until the open mini-batch changes: waiting
groups are kept per class, and only a release triggers a FIFO rescan of the class queues' heads.
"""

import collections
import dataclasses
import heapq
import numbers
from collections.abc import Callable, Mapping, Sequence

from knitjax.transfer.feasibility import FeasibilityTracker, balanced_split, completion_feasible
from knitjax.transfer.group import GroupIdSet, GroupMeta
from knitjax.transfer.quota import QuotaSpec

POLICIES = ("train_batch", "minibatch", "greedy")

_STATE_VERSION = 2  # 2: "seen" (every group id offered), so a re-offer is refused after resume
_STATE_KEYS = (
  "version",
  "policy",
  "spec",
  "step",
  "index",
  "seq",
  "placed",
  "open",
  "waiting",
  "stalled",
  "counters",
  "seen",
)
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

  def open_groups(self) -> tuple[GroupMeta, ...]:
    """Groups placed in the open mini-batch (not released yet), in placed order."""
    return tuple(self._open)

  def waiting(self) -> list[GroupMeta]:
    """Pending groups not placed in any mini-batch yet, in arrival (FIFO) order."""
    return [g for _, g in sorted(e for q in self._waiting for e in q)]

  def pending(self) -> list[GroupMeta]:
    """Every offered group not yet released (placed in the open mini-batch, then waiting FIFO)."""
    return list(self._open) + self.waiting()

  def stats(self) -> dict:
    """Counters (cumulative) and the current backlog.

    Keys: ``offered``, ``admitted`` (placed into a mini-batch), ``rejected`` (dynamic sampling),
    ``released_minibatches``, ``released_groups``, ``released_steps``, ``quota_violations``
    (released steps whose class counts differ from the quotas), ``bound_violations`` (released
    mini-batches with a class outside its min/max), ``violations`` (their sum), ``stalls``
    (mini-batches that stalled, see docs/admission.md), ``checks`` (admissibility checks made),
    ``pending`` and ``pending_per_class``
    (offered, not released), ``waiting`` (pending, not yet placed), ``step``, ``minibatch_index``.
    """
    pending_per_class = {c: len(q) for c, q in zip(self.spec.classes, self._waiting, strict=True)}
    for g in self._open:
      pending_per_class[g.cls] += 1
    out = dict(self._counters)
    out["violations"] = out["quota_violations"] + out["bound_violations"]
    out["pending"] = sum(pending_per_class.values())
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
    """Plain-Python checkpoint of the whole index, pending groups and seen group ids included."""
    waiting = sorted(e for q in self._waiting for e in q)
    return {
      "version": _STATE_VERSION,
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
    step, index, seq, placed, open_groups, waiting, seen = self._checked_state(state)
    self._reset(step=step, index=index, seq=seq)
    self._placed = placed
    self._open = open_groups
    counts = [0] * len(self._quotas)
    for g in open_groups:
      counts[self._class_index[g.cls]] += 1
      self._pending_ids.add(g.group_id)
    for s, g in waiting:
      self._waiting[self._class_index[g.cls]].append((s, g))
      self._pending_ids.add(g.group_id)
    remaining = [q - p for q, p in zip(self._quotas, placed, strict=True)]
    self._tracker.set_state(counts, remaining, self.spec.minibatches - 1 - index)
    self._open_counts = counts
    self._short = sum(self._is_short(c) for c in range(len(self._quotas)))
    self._stalled = state["stalled"]
    self._counters = {k: int(state["counters"][k]) for k in _COUNTERS}
    self._seen = seen

  # ---- checkpoint checks ------------------------------------------------------------------------

  def _checked_state(self, state) -> tuple:
    """The parts of a `state_dict`, checked as a whole against this index; changes nothing.

    Returns ``(step, index, seq, placed, open groups, waiting (seq, group) pairs, seen ids)``.
    """
    if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
      version = state.get("version") if isinstance(state, Mapping) else type(state).__name__
      raise ValueError(
        f"admission state version {version!r} is not {_STATE_VERSION}; "
        "it was written by an incompatible knitjax."
      )
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing:
      raise _bad(f"keys {missing} are missing; accepted: a dict from AdmissionIndex.state_dict().")
    try:
      spec = QuotaSpec(**state["spec"])
    except (TypeError, ValueError) as e:
      raise _bad(f"spec {state['spec']!r} is not a quota spec ({e})") from None
    if state["policy"] != self.policy or spec != self.spec:
      raise ValueError(
        f"admission state was saved with policy={state['policy']!r} and spec {state['spec']}; "
        f"this index has policy={self.policy!r} and spec {self.spec.to_dict()}."
      )
    m = self.spec.minibatches
    step, index, seq = state["step"], state["index"], state["seq"]
    for name, value in (("step", step), ("seq", seq)):
      if not _is_int(value) or value < 0:
        raise _bad(f"{name}={value!r}; accepted: an int >= 0.")
    if not _is_int(index) or not 0 <= index < m:
      raise _bad(f"index={index!r}; accepted: an int in [0, {m}).")
    if not isinstance(state["stalled"], bool):
      raise _bad(f"stalled={state['stalled']!r}; accepted: True or False.")
    counters = state["counters"]
    if not isinstance(counters, Mapping) or any(
      not _is_int(counters.get(k)) or counters[k] < 0 for k in _COUNTERS
    ):
      raise _bad(f"counters={counters!r}; accepted: each of {list(_COUNTERS)} as an int >= 0.")
    placed = state["placed"]
    classes = self.spec.classes
    if (
      not isinstance(placed, Mapping)
      or set(placed) != set(classes)
      or any(not _is_int(v) or v < 0 for v in placed.values())
    ):
      raise _bad(f"placed={placed!r}; accepted: each class of {list(classes)} as an int >= 0.")
    placed = [int(placed[c]) for c in classes]  # by name: the saved order may differ
    try:
      seen = GroupIdSet.from_ranges(state["seen"])
    except ValueError as e:
      raise _bad(f"seen: {e}") from None
    open_groups, waiting = self._checked_groups(state["open"], state["waiting"], seq, seen)
    self._check_placements(step, index, placed, open_groups)
    return step, index, seq, placed, open_groups, waiting, seen

  def _checked_groups(self, open_raw, waiting_raw, seq: int, seen: GroupIdSet) -> tuple:
    """Open groups and waiting ``(arrival, group)`` pairs: valid, known classes, ids unique."""
    for name, raw in (("open", open_raw), ("waiting", waiting_raw)):
      if isinstance(raw, str | bytes) or not isinstance(raw, Sequence):
        raise _bad(f"{name}={raw!r}; accepted: a list as state_dict() writes it.")
    open_groups = [self._state_group(d, "open") for d in open_raw]
    waiting, last = [], -1
    for entry in waiting_raw:
      if not isinstance(entry, Sequence) or len(entry) != 2 or not _is_int(entry[0]):
        raise _bad(f"waiting entry {entry!r} is not an [arrival number, group] pair.")
      g = self._state_group(entry[1], "waiting")
      if not last < entry[0] < seq:
        raise _bad(
          f"waiting group {g.group_id} has arrival number {entry[0]}; accepted: numbers "
          f"increasing along the list and below seq={seq}."
        )
      last = entry[0]
      waiting.append((int(entry[0]), g))
    where_of: dict[int, str] = {}
    for where, g in [("open", g) for g in open_groups] + [("waiting", g) for _, g in waiting]:
      if g.group_id in where_of:
        if where_of[g.group_id] == where:
          raise _bad(f"group {g.group_id} appears twice in the {where} groups.")
        raise _bad(f"group {g.group_id} appears in both the open and the waiting groups.")
      where_of[g.group_id] = where
      if g.group_id not in seen:
        raise _bad(f"pending group {g.group_id} is missing from the seen group ids.")
    return open_groups, waiting

  def _state_group(self, d, where: str) -> GroupMeta:
    try:
      g = GroupMeta.from_dict(d)
    except (TypeError, ValueError) as e:
      raise _bad(f"an entry of the {where} groups is not a group record ({e})") from None
    if g.cls not in self._class_index:
      raise _bad(
        f"{where} group {g.group_id} has class {g.cls!r}, which the quota spec does not name "
        f"(classes: {list(self.spec.classes)})."
      )
    return g

  def _check_placements(self, step: int, index: int, placed: list, open_groups: list) -> None:
    """Placements that this policy could have made in step `step` up to mini-batch `index`."""
    size, n = self._size, len(self._quotas)
    counts = [0] * n
    for g in open_groups:
      counts[self._class_index[g.cls]] += 1
    if len(open_groups) >= size:
      raise _bad(
        f"the open mini-batch holds {len(open_groups)} groups; accepted: fewer than {size} "
        "(a full one is released)."
      )
    if self.policy == "train_batch" and (open_groups or index or any(placed)):
      raise _bad(
        "a train_batch index places no group before it releases a whole step; accepted: "
        "open=[], index=0 and placed all 0."
      )
    if sum(placed) != index * size + len(open_groups):
      raise _bad(
        f"placed counts {sum(placed)} groups in step {step}, but {index} released mini-batches "
        f"of {size} and {len(open_groups)} open groups make {index * size + len(open_groups)}."
      )
    for c, name in enumerate(self.spec.classes):
      lo, hi, q = self._lows[c], self._highs[c], self._quotas[c]
      done = placed[c] - counts[c]  # in the released mini-batches of this step
      if done < 0:
        raise _bad(
          f"the open mini-batch holds {counts[c]} groups of class {name!r}, more than "
          f"placed[{name!r}]={placed[c]}."
        )
      if counts[c] > hi:
        raise _bad(
          f"the open mini-batch holds {counts[c]} groups of class {name!r}, over its "
          f"max_per_minibatch of {hi}."
        )
      if done > index * hi:
        raise _bad(
          f"class {name!r} has {done} groups in the {index} released mini-batches of step "
          f"{step}, over {index} x its max_per_minibatch of {hi}."
        )
      if self.policy == "greedy":
        continue  # greedy ignores quotas and minimum bounds (counted as violations)
      if placed[c] > q:
        raise _bad(
          f"class {name!r} has {placed[c]} groups placed in step {step}, over its quota of {q}."
        )
      if done < index * lo:
        raise _bad(
          f"class {name!r} has {done} groups in the {index} released mini-batches of step "
          f"{step}, under {index} x its min_per_minibatch of {lo}."
        )
    remaining = [q - p for q, p in zip(self._quotas, placed, strict=True)]
    empty = self.spec.minibatches - 1 - index
    if self.policy == "minibatch" and not completion_feasible(
      self._lows, self._highs, size, counts, remaining, empty
    ):
      raise _bad(
        f"step {step} cannot be completed within the per-mini-batch bounds from its placements "
        f"(open mini-batch {dict(zip(self.spec.classes, counts, strict=True))}, still missing "
        f"{dict(zip(self.spec.classes, remaining, strict=True))})."
      )

  # ---- internals --------------------------------------------------------------------------------

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


def _bad(problem: str) -> ValueError:
  return ValueError(f"admission state: {problem}")


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)
