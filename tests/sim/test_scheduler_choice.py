"""The simulator's scheduler choice (`Pipeline.scheduling`): each name builds its scheduler; the
admission-aware one is need-driven and throttled."""

import pytest

from knitjax.rollout.scheduling import PlainScheduler
from knitjax.sim.scheduling import SCHEDULING, AdmissionAwareScheduler, make_scheduler
from knitjax.sim.workload import Pipeline
from knitjax.transfer.admission import AdmissionIndex
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.quota import QuotaSpec


def test_each_scheduling_name_builds_its_scheduler():
  index = AdmissionIndex(QuotaSpec({"a": 3, "b": 1}, 2), "minibatch")
  built = {kind: make_scheduler(kind, index, [3, 1], horizon_steps=2) for kind in SCHEDULING}
  assert type(built["plain"]) is PlainScheduler
  assert type(built["admission_aware"]) is AdmissionAwareScheduler
  with pytest.raises(ValueError, match="choose one of: plain, admission_aware"):
    make_scheduler("fifo", index, [3, 1], horizon_steps=2)


def test_pipeline_accepts_exactly_the_scheduling_names():
  for kind in SCHEDULING:
    assert Pipeline(scheduling=kind).scheduling == kind
  with pytest.raises(ValueError, match="Pipeline.scheduling='fifo' is not accepted"):
    Pipeline(scheduling="fifo")


def _group(gid, cls):
  return GroupMeta(
    group_id=gid,
    cls=cls,
    gen_version=0,
    num_samples=1,
    prompt_tokens=(1,),
    response_tokens=(1,),
    reward_std=1.0,
  )


def test_admission_aware_starts_what_is_missing_then_throttles():
  index = AdmissionIndex(QuotaSpec({"a": 3, "b": 1}, 2), "minibatch", dynamic_sampling=True)
  s = AdmissionAwareScheduler(index, [3, 1], horizon_steps=1)
  started = []
  while (c := s.next_class()) is not None:
    s.on_start(c)
    started.append(c)
  assert sorted(started) == [0, 0, 0, 1]  # exactly one step's needs, then throttled
  # Class b's group is rejected by dynamic sampling: b is missing again, a is not.
  s.on_complete(1, accepted=False)
  assert s.next_class() == 1
  # With a 2-step horizon, the next step's needs open up.
  s2 = AdmissionAwareScheduler(index, [3, 1], horizon_steps=2)
  index.offer(_group(0, "a"))
  count = 0
  while s2.next_class() is not None and count < 20:
    s2.on_start(s2.next_class())
    count += 1
  assert count == 7  # 8 groups for two steps, one already complete
