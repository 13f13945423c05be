"""Workload and Pipeline validation: one clear sentence naming the field."""

import dataclasses

import pytest

from knitjax.sim.workload import ClassSpec, Pipeline


def test_quota_spec_carries_classes_and_bounds(make_tiny):
  w = make_tiny()
  spec = w.quota_spec()
  assert spec.class_quotas == {"a": 6, "b": 2}
  assert spec.min_per_minibatch == {"b": 1}
  assert spec.max_per_minibatch == {}
  assert (w.groups_per_step, w.groups_per_minibatch) == (8, 4)


@pytest.mark.parametrize(
  ("changes", "match"),
  [
    ({"quota": 0}, "quota"),
    ({"length_cv": -1.0}, "length_cv"),
    ({"length_max": 0}, "length_max"),
    ({"reject_prob": 1.0}, "reject_prob"),
  ],
)
def test_bad_class_fields_are_named(changes, match):
  with pytest.raises(ValueError, match=match):
    ClassSpec(name="x", **{"quota": 4, **changes})


def test_bad_workload_fields_are_named(make_tiny):
  w = make_tiny()
  with pytest.raises(ValueError, match="slots"):
    dataclasses.replace(w, slots=2)
  with pytest.raises(ValueError, match="decode_s_per_token"):
    dataclasses.replace(w, decode_s_per_token=0.0)
  with pytest.raises(ValueError, match="repeated names"):
    dataclasses.replace(w, classes=(w.classes[0], w.classes[0]))
  # The quota spec's own check: 6 + 2 groups do not split into 3 mini-batches.
  with pytest.raises(ValueError, match="minibatches"):
    dataclasses.replace(w, minibatches=3)


def test_pipeline_choices_and_depth_grid(make_tiny):
  with pytest.raises(ValueError, match="policy"):
    Pipeline(policy="fifo")
  with pytest.raises(ValueError, match="max_lag_steps"):
    Pipeline(max_lag_steps=-0.5)
  w = make_tiny()
  assert Pipeline(max_lag_steps=1.5).lag_groups(w) == 12
  with pytest.raises(ValueError, match="1/M"):
    Pipeline(max_lag_steps=0.25).lag_groups(w)
