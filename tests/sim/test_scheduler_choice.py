"""The simulator's scheduler choice (`Pipeline.scheduling`): each name builds its scheduler."""

import pytest

from knitjax.rollout.scheduling import AdmissionAwareScheduler, PlainScheduler
from knitjax.sim.scheduling import SCHEDULING, make_scheduler
from knitjax.sim.workload import Pipeline
from knitjax.transfer.admission import AdmissionIndex
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
