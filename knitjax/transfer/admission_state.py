"""Checks a saved admission state before an `AdmissionIndex` restores it.

A checkpoint can be damaged (truncated, hand-edited, written by an older knitjax) or foreign
(saved under another quota spec or policy). Restoring such a state would leave the index in a
place its algorithm never reaches: a step that cannot complete, a group placed twice, a re-offer
that is no longer refused. So `check_state` checks the whole state first, changing nothing, and
raises a `ValueError` whose one sentence names the first problem and what would be accepted; the
index is left as it was.

Beyond the types and ranges of each field, the state must be one the policy could have produced:
pending group ids are unique and seen, waiting groups keep their arrival order, and the placed
counts of the current step fit the released mini-batches, the open one and the per-class bounds
(for ``minibatch``, the step must also still be completable).

This module knows the state format but not the index: the caller passes the spec, the policy and
its counter names, so nothing here imports `admission`.
"""

import dataclasses
import numbers
from collections.abc import Mapping, Sequence

from knitjax.transfer.feasibility import completion_feasible
from knitjax.transfer.group import GroupIdSet, GroupMeta
from knitjax.transfer.quota import QuotaSpec

STATE_VERSION = 2  # 2: "seen" (every group id offered), so a re-offer is refused after resume
STATE_KEYS = (
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


@dataclasses.dataclass(frozen=True)
class CheckedState:
  """The parts of a checked `AdmissionIndex.state_dict`, parsed; the lists are fresh copies.

  `placed` is per class in spec order, `waiting` holds ``(arrival number, group)`` pairs in
  arrival order, `counters` holds every counter name as an int.
  """

  step: int
  index: int
  seq: int
  placed: list[int]
  open_groups: list[GroupMeta]
  waiting: list[tuple[int, GroupMeta]]
  seen: GroupIdSet
  stalled: bool
  counters: dict[str, int]


def check_state(
  state, *, spec: QuotaSpec, policy: str, counter_names: Sequence[str]
) -> CheckedState:
  """Checks `state` as a whole against an index with `spec` and `policy`; changes nothing.

  Args:
    state: a dict as `AdmissionIndex.state_dict` writes it (possibly through JSON).
    spec: the restoring index's quota spec; the saved one must equal it.
    policy: the restoring index's policy; the saved one must equal it.
    counter_names: the counters the index keeps; each must be saved as an int >= 0.

  Raises:
    ValueError: one sentence naming the first problem found.
  """
  if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
    version = state.get("version") if isinstance(state, Mapping) else type(state).__name__
    raise ValueError(
      f"admission state version {version!r} is not {STATE_VERSION}; "
      "it was written by an incompatible knitjax."
    )
  missing = [k for k in STATE_KEYS if k not in state]
  if missing:
    raise _bad(f"keys {missing} are missing; accepted: a dict from AdmissionIndex.state_dict().")
  try:
    saved_spec = QuotaSpec(**state["spec"])
  except (TypeError, ValueError) as e:
    raise _bad(f"spec {state['spec']!r} is not a quota spec ({e})") from None
  if state["policy"] != policy or saved_spec != spec:
    raise ValueError(
      f"admission state was saved with policy={state['policy']!r} and spec {state['spec']}; "
      f"this index has policy={policy!r} and spec {spec.to_dict()}."
    )
  m = spec.minibatches
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
    not _is_int(counters.get(k)) or counters[k] < 0 for k in counter_names
  ):
    raise _bad(f"counters={counters!r}; accepted: each of {list(counter_names)} as an int >= 0.")
  placed = state["placed"]
  classes = spec.classes
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
  open_groups, waiting = _checked_groups(spec, state["open"], state["waiting"], seq, seen)
  _check_placements(spec, policy, step, index, placed, open_groups)
  return CheckedState(
    step=step,
    index=index,
    seq=seq,
    placed=placed,
    open_groups=open_groups,
    waiting=waiting,
    seen=seen,
    stalled=state["stalled"],
    counters={k: int(counters[k]) for k in counter_names},
  )


def _checked_groups(spec: QuotaSpec, open_raw, waiting_raw, seq: int, seen: GroupIdSet) -> tuple:
  """Open groups and waiting ``(arrival, group)`` pairs: valid, known classes, ids unique."""
  for name, raw in (("open", open_raw), ("waiting", waiting_raw)):
    if isinstance(raw, str | bytes) or not isinstance(raw, Sequence):
      raise _bad(f"{name}={raw!r}; accepted: a list as state_dict() writes it.")
  open_groups = [_state_group(spec, d, "open") for d in open_raw]
  waiting, last = [], -1
  for entry in waiting_raw:
    if not isinstance(entry, Sequence) or len(entry) != 2 or not _is_int(entry[0]):
      raise _bad(f"waiting entry {entry!r} is not an [arrival number, group] pair.")
    g = _state_group(spec, entry[1], "waiting")
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


def _state_group(spec: QuotaSpec, d, where: str) -> GroupMeta:
  try:
    g = GroupMeta.from_dict(d)
  except (TypeError, ValueError) as e:
    raise _bad(f"an entry of the {where} groups is not a group record ({e})") from None
  if g.cls not in spec.classes:
    raise _bad(
      f"{where} group {g.group_id} has class {g.cls!r}, which the quota spec does not name "
      f"(classes: {list(spec.classes)})."
    )
  return g


def _check_placements(
  spec: QuotaSpec, policy: str, step: int, index: int, placed: list, open_groups: list
) -> None:
  """Placements that `policy` could have made in step `step` up to mini-batch `index`."""
  classes, size = spec.classes, spec.groups_per_minibatch
  quotas = [spec.class_quotas[c] for c in classes]
  lows = [spec.min_of(c) for c in classes]
  highs = [spec.max_of(c) for c in classes]
  counts = [sum(g.cls == name for g in open_groups) for name in classes]
  if len(open_groups) >= size:
    raise _bad(
      f"the open mini-batch holds {len(open_groups)} groups; accepted: fewer than {size} "
      "(a full one is released)."
    )
  if policy == "train_batch" and (open_groups or index or any(placed)):
    raise _bad(
      "a train_batch index places no group before it releases a whole step; accepted: "
      "open=[], index=0 and placed all 0."
    )
  if sum(placed) != index * size + len(open_groups):
    raise _bad(
      f"placed counts {sum(placed)} groups in step {step}, but {index} released mini-batches "
      f"of {size} and {len(open_groups)} open groups make {index * size + len(open_groups)}."
    )
  for c, name in enumerate(classes):
    lo, hi, q = lows[c], highs[c], quotas[c]
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
    if policy == "greedy":
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
  remaining = [q - p for q, p in zip(quotas, placed, strict=True)]
  empty = spec.minibatches - 1 - index
  if policy == "minibatch" and not completion_feasible(lows, highs, size, counts, remaining, empty):
    raise _bad(
      f"step {step} cannot be completed within the per-mini-batch bounds from its placements "
      f"(open mini-batch {dict(zip(classes, counts, strict=True))}, still missing "
      f"{dict(zip(classes, remaining, strict=True))})."
    )


def _bad(problem: str) -> ValueError:
  return ValueError(f"admission state: {problem}")


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)
