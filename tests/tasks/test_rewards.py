"""Tests for knitjax.tasks.rewards (the registry)."""

import pytest

from knitjax.tasks import rewards


def test_registry():
  assert set(rewards.REWARDS) == {
    "arith_first",
    "arith_exact",
    "numeric_match",
    "longtail",
    "count_exact",
  }
  for name, fn in rewards.REWARDS.items():
    assert rewards.get_reward_fn(name) is fn


def test_unknown_reward():
  with pytest.raises(ValueError) as e:
    rewards.get_reward_fn("x")
  assert (
    str(e.value)
    == "unknown reward 'x'; choose one of: arith_first, arith_exact, numeric_match, longtail, "
    "count_exact"
  )
