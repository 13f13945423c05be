"""QuotaSpec validation: every conflict is a ValueError that names it."""

import pytest

from knitjax.transfer.quota import QuotaSpec


def test_sizes_and_bounds():
  spec = QuotaSpec({"math": 6, "count": 2}, 4, {"count": 0}, {"count": 1})
  assert (spec.groups_per_step, spec.groups_per_minibatch) == (8, 2)
  assert spec.classes == ("math", "count")
  assert (spec.min_of("math"), spec.max_of("math"), spec.max_of("count")) == (0, 2, 1)
  assert QuotaSpec(**spec.to_dict()) == spec
  assert hash(QuotaSpec(**spec.to_dict())) == hash(spec)


def test_spec_copies_its_mappings():
  quotas = {"a": 4}
  spec = QuotaSpec(quotas, 2)
  quotas["a"] = 5
  assert spec.class_quotas == {"a": 4}


@pytest.mark.parametrize(
  "args, message",
  [
    (({}, 1), "class_quotas is empty"),
    (({"a": 0}, 1), r"class_quotas\['a'\]=0"),
    (({"a": 2.0}, 1), r"class_quotas\['a'\]=2.0"),
    (({"a": 4}, 0), "minibatches=0"),
    (({"a": 3, "b": 2}, 2), "sum to 5 groups per step, which minibatches=2 does not divide"),
    (({"a": 4}, 2, {"z": 1}), "min_per_minibatch names class 'z'"),
    (({"a": 4}, 2, {}, {"a": -1}), r"max_per_minibatch\['a'\]=-1"),
    (({"a": 4, "b": 4}, 4, {"a": 2}, {"a": 1}), r"min_per_minibatch\['a'\]=2 exceeds"),
    (({"a": 2, "b": 6}, 4, {"a": 1}), r"needs 4 groups, but class_quotas\['a'\]=2"),
    (({"a": 6, "b": 2}, 4, {}, {"a": 1}), r"class_quotas\['a'\]=6 does not fit in 4 mini-batches"),
  ],
)
def test_conflicts_are_named(args, message):
  with pytest.raises(ValueError, match=message):
    QuotaSpec(*args)


def test_joint_satisfiability_is_per_class():
  # Per-class M*lo <= q <= M*hi is enough (docs/admission.md); this spec is tight everywhere.
  spec = QuotaSpec({"a": 4, "b": 4, "c": 8}, 4, {"a": 1, "b": 1, "c": 2}, {"a": 1, "b": 1, "c": 2})
  assert spec.groups_per_minibatch == 4
