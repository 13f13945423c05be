"""A tiny simulator preset shared by the simulator tests (runs in well under a second)."""

import pytest

from knitjax.sim.costs import calibrate_trainer
from knitjax.sim.workload import ClassSpec, Workload


def tiny_workload(**changes) -> Workload:
  """Two classes, G=4, B=8 (6 + 2, at least 1 `b` per mini-batch), M=2, 32 slots."""
  classes = (
    ClassSpec(
      name="a",
      quota=6,
      length_mean=200.0,
      length_cv=1.0,
      length_max=2000,
      prompt_tokens=16,
      reject_prob=changes.pop("reject_a", 0.0),
    ),
    ClassSpec(
      name="b",
      quota=2,
      min_per_minibatch=1,
      length_mean=60.0,
      length_cv=0.5,
      length_max=400,
      prompt_tokens=32,
      reject_prob=changes.pop("reject_b", 0.0),
    ),
  )
  w = Workload(
    classes=classes,
    group_size=4,
    minibatches=2,
    slots=32,
    decode_s_per_token=0.01,
    prefill_s_per_token=1e-4,
    weight_sync_s=0.1,
    **changes,
  )
  return calibrate_trainer(w)


@pytest.fixture
def make_tiny():
  """The `tiny_workload` factory (keyword changes override Workload fields)."""
  return tiny_workload
