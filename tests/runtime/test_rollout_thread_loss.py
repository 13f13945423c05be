"""The rollout thread's side of a storage unit lost with its node: the groups given up once each,
released mini-batches reopened in place and refilled, the lost prompts started again first."""

import dataclasses
import threading

from knitjax.rollout.contract import RolloutStats
from knitjax.runtime.released import ReleasedQueue
from knitjax.runtime.rollout_thread import RolloutThread
from knitjax.transfer.admission import AdmissionIndex
from knitjax.transfer.quota import QuotaSpec
from tests.transfer.test_admission import group


class _Rollout:
  def __init__(self):
    self.lost = ()

  def stats(self):
    return RolloutStats(lost_units=self.lost)


class _Prompts:
  def next(self, counts):
    ((cls, _),) = counts.items()
    return [f"fresh {cls}"]


def test_lost_groups_are_given_up_once_and_their_prompts_start_first():
  spec = QuotaSpec({"a": 2, "b": 2}, 2, {}, {})
  index, queue, rows = AdmissionIndex(spec), ReleasedQueue(), []
  thread = RolloutThread(
    rollout=_Rollout(),
    prompts=_Prompts(),
    admission=index,
    queue=queue,
    clock=None,
    weights=None,
    lock=threading.Lock(),
    next_group_id=0,
    accepted_started=5,
    rng=None,
    on_lost=lambda groups, where, units: rows.append(([g.group_id for g in groups], where, units)),
  )
  # groups 0-4: mini-batches (0, 0) = [0 a on unit 1, 1 b], (0, 1) = [2 a on unit 1, 3 b]; 4 open
  units = [1, 0, 1, 0, 0]
  classes = ["a", "b", "a", "b", "b"]
  for gid, (u, c) in enumerate(zip(units, classes, strict=True)):
    thread._inflight[gid] = f"prompt {gid}"
    thread._offer(dataclasses.replace(group(gid, c), storage_unit=u))
  first = queue.items()
  assert [[g.group_id for g in mb.groups] for mb in first] == [[0, 1], [2, 3]]
  (open_,) = index.open_groups()
  assert open_.group_id == 4

  thread._lose({1})
  assert rows == [([0, 2], ["released", "released"], {1})]  # each lost group once
  assert list(thread._restart) == ["prompt 0", "prompt 2"]  # the same prompts, first
  assert thread.accepted_started == 3 and thread.lost_units == {1}
  assert queue.items(whole=True) == [] and index.refilling == [(0, 0), (0, 1)]
  assert queue.get(0) is None  # the feed waits for the refilled mini-batch

  for gid, c in ((6, "a"), (7, "a")):  # the prompts made again, on the unit left
    thread._inflight[gid] = f"again {gid}"
    thread._offer(group(gid, c))
  refilled = queue.items()
  assert [[g.group_id for g in mb.groups] for mb in refilled] == [[6, 1], [7, 3]]
  assert index.refilling == [] and queue.get(0) is refilled[0]
  assert queue.reopened(first[0]) and not queue.reopened(refilled[0])  # a fetch of the old fails
  s = index.stats()
  assert (s["offered"], s["lost"], s["pending"]) == (7, 2, 1)  # 4 released again, 4 pending
