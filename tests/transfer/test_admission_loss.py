"""Groups lost with their storage unit: eviction from the admission index, reopened mini-batches
refilled by replacements of the same classes, and the released queue's side of it."""

import collections
import dataclasses
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from knitjax.runtime.released import ReleasedQueue
from knitjax.transfer.admission import AdmissionIndex
from knitjax.transfer.quota import QuotaSpec
from tests.transfer.test_admission import PROPS, group, key, oracle, step_state, workloads

LOST = 1  # the storage unit lost in these tests


def on(g, unit):
  return dataclasses.replace(g, storage_unit=unit)


def check_minibatches(spec, minibatches):
  """Each mini-batch within its bounds and of B/M groups, consecutive, steps at their quotas."""
  assert [(mb.step, mb.index) for mb in minibatches] == [
    divmod(n, spec.minibatches) for n in range(len(minibatches))
  ]
  by_step = collections.defaultdict(collections.Counter)
  for mb in minibatches:
    assert len(mb.groups) == spec.groups_per_minibatch
    counts = collections.Counter(g.cls for g in mb.groups)
    for c in spec.classes:
      assert spec.min_of(c) <= counts[c] <= spec.max_of(c)
    by_step[mb.step].update(counts)
  for step, counts in by_step.items():
    if by_step and len([mb for mb in minibatches if mb.step == step]) == spec.minibatches:
      assert dict(counts) == dict(spec.class_quotas)


@PROPS
@given(
  workloads(),
  st.sampled_from(["minibatch", "train_batch", "greedy"]),
  st.data(),
)
def test_lost_groups_are_given_up_once_and_their_places_refilled(workload, policy, data):
  spec, _, groups = workload
  units = data.draw(st.lists(st.integers(0, 1), min_size=len(groups), max_size=len(groups)))
  groups = [on(g, u) for g, u in zip(groups, units, strict=True)]
  cut = data.draw(st.integers(0, len(groups)))
  idx = AdmissionIndex(spec, policy)
  queue = []  # released, not consumed: the trainer's queue (reopened ones stay in place)
  for g in groups[:cut]:
    queue += idx.offer(g)
  held_back = data.draw(st.integers(0, len(queue)))  # the trainer consumed the others
  consumed, queue = queue[: len(queue) - held_back], queue[len(queue) - held_back :]

  lost, released = idx.evict({LOST})
  queue += released
  for mb in queue:
    ids = [g.group_id for g in mb.groups if g.storage_unit == LOST]
    if ids:
      idx.reopen(mb, ids)
      lost += [g for g in mb.groups if g.group_id in ids]
  assert idx.stats()["lost"] == len(lost)
  assert all(g.storage_unit == LOST for g in lost)
  if policy == "minibatch":  # the step can still be completed after the eviction
    assert oracle(key(spec), *step_state(spec, idx, consumed + queue))

  # the lost groups' prompts start again first (same classes, new ids, on the unit left); the
  # groups not offered yet were generating on both workers: the one left makes them all
  next_id = len(groups)
  again = [group(next_id + k, g.cls) for k, g in enumerate(lost)]
  for g in again + [on(g, 0) for g in groups[cut:]]:
    for mb in idx.offer(g):
      at = [k for k, q in enumerate(queue) if (q.step, q.index) == (mb.step, mb.index)]
      if at:
        queue[at[0]] = mb
      else:
        queue.append(mb)
  assert idx.refilling == []  # a replacement of each lost group's class came
  minibatches = consumed + queue
  if policy != "greedy":
    check_minibatches(spec, minibatches)
  out = [g.group_id for mb in minibatches for g in mb.groups]
  pending = [g.group_id for g in idx.pending()]
  gone = [g.group_id for g in lost]
  assert len(out) == len(set(out))  # none released twice
  assert not set(gone) & set(out + pending)  # a lost group is never consumed
  offered = [g.group_id for g in groups] + [g.group_id for g in again]
  assert sorted(out + pending + gone) == sorted(offered)  # offered = released + pending + lost
  s = idx.stats()
  assert s["offered"] == len(out) + s["pending"] + s["lost"] + s["rejected"]
  if policy != "greedy":
    assert s["violations"] == 0


def test_evicting_an_open_group_lets_a_waiting_group_in():
  # a: 2, b: 2 per step, 2 mini-batches of 2 with at most 1 b each
  spec = QuotaSpec({"a": 2, "b": 2}, 2, {}, {"b": 1})
  idx = AdmissionIndex(spec)
  assert idx.offer(on(group(0, "b"), LOST)) == []
  assert idx.offer(group(1, "b")) == []  # a second b does not fit the open mini-batch: waits
  assert [g.group_id for g in idx.waiting()] == [1]
  lost, released = idx.evict({LOST})
  assert [g.group_id for g in lost] == [0]
  assert released == [] and [g.group_id for g in idx.open_groups()] == [1]
  assert idx.remaining() == {"a": 2, "b": 1}  # the lost b's quota slot reopened
  (mb,) = idx.offer(group(2, "a"))
  assert [g.group_id for g in mb.groups] == [1, 2]
  s = idx.stats()
  assert (s["lost"], s["pending"], s["offered"]) == (1, 0, 3)


def test_a_reopened_minibatch_is_refilled_by_its_classes_first():
  spec = QuotaSpec({"a": 2, "b": 2}, 2, {}, {})
  idx = AdmissionIndex(spec)
  (mb,) = [m for g in (group(0, "a"), on(group(1, "b"), LOST)) for m in idx.offer(g)]
  idx.reopen(mb, [1])
  assert idx.refilling == [(0, 0)]
  assert [g.group_id for g in idx.pending()] == [0]
  assert idx.offer(group(2, "a")) == []  # not the lost class: admitted as usual
  assert [g.group_id for g in idx.open_groups()] == [2]
  (refilled,) = idx.offer(group(3, "b"))
  assert (refilled.step, refilled.index) == (0, 0)
  assert [g.group_id for g in refilled.groups] == [0, 3]  # the lost group's place
  assert idx.refilling == [] and [g.group_id for g in idx.pending()] == [2]
  assert idx.stats()["lost"] == 1
  with pytest.raises(ValueError, match="not all in mini-batch"):
    idx.reopen(refilled, [99])


def test_no_checkpoint_while_refilling_and_old_states_load():
  spec = QuotaSpec({"a": 2}, 1, {}, {})
  idx = AdmissionIndex(spec)
  idx.offer(group(0, "a"))
  (mb,) = idx.offer(on(group(1, "a"), LOST))
  old = idx.state_dict()
  idx.reopen(mb, [1])
  with pytest.raises(RuntimeError, match="still being refilled"):
    idx.state_dict()
  del old["counters"]["lost"]  # saved before groups could be lost
  fresh = AdmissionIndex(spec)
  fresh.load_state_dict(old)
  assert fresh.stats()["lost"] == 0 and fresh.stats()["offered"] == 2


def test_released_queue_holds_a_reopened_minibatch_in_place():
  spec = QuotaSpec({"a": 2}, 2, {}, {})
  idx = AdmissionIndex(spec)
  first = idx.offer(on(group(0, "a"), LOST))[0]
  second = idx.offer(group(1, "a"))[0]
  q = ReleasedQueue()
  q.put(first)
  q.put(second)
  assert q.get(0) is first  # the feed took it (prefetching)
  assert q.reopen(first)
  idx.reopen(first, [0])
  assert q.reopened(first) and q.items(whole=True) == [second]
  got = []
  t = threading.Thread(target=lambda: got.append(q.claim(first, 5.0)))
  t.start()  # the trainer waits for the refill
  (refilled,) = idx.offer(group(2, "a"))
  assert q.reopened(refilled)
  q.refill(refilled)
  t.join(5)
  assert got == [refilled] and not q.reopened(refilled)
  assert q.claim(refilled, 0) is refilled  # claimed: consumed as fetched, never reopened
  assert not q.reopen(refilled)
  q.ack(refilled)
  assert q.get(0) is second and q.items() == [second]
