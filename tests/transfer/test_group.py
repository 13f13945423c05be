"""GroupMeta validation and round trip."""

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitjax.transfer.group import GroupIdSet, GroupMeta

BASE = dict(
  group_id=7,
  cls="math",
  gen_version=3,
  num_samples=2,
  prompt_tokens=(4, 4),
  response_tokens=(10, 6),
)


def test_fields_and_round_trip():
  g = GroupMeta(**BASE, image_hashes=["ab"], gen_version_newest=5, reward_std=0.5)
  assert g.image_hashes == ("ab",)  # lists become tuples
  assert (g.total_tokens, g.newest_version) == (24, 5)
  assert GroupMeta(**BASE).newest_version == 3
  assert GroupMeta.from_dict(g.to_dict()) == g
  assert GroupMeta(**{**BASE, "group_id": np.int64(7)}).group_id == 7


@pytest.mark.parametrize(
  "change, message",
  [
    ({"cls": ""}, "GroupMeta.cls=''"),
    ({"gen_version": -1}, "gen_version=-1"),
    ({"gen_version_newest": 2}, "gen_version_newest=2 must be None or an int >= gen_version=3"),
    ({"num_samples": 0}, "num_samples=0"),
    ({"prompt_tokens": (4,)}, "prompt_tokens has 1 entries but num_samples=2"),
    ({"response_tokens": (1, -1)}, "response_tokens=.* must hold ints >= 0"),
    ({"reward_std": -0.1}, "reward_std=-0.1"),
    ({"reward_mean": float("nan")}, "reward_mean=nan must be a finite number"),
    ({"storage_unit": -2}, "storage_unit=-2"),
    ({"image_hashes": ("",)}, "image_hashes"),
    ({"group_id": "7"}, "group_id='7'"),
    ({"reward_mean": "0.5"}, "reward_mean='0.5' must be a finite number"),
    ({"reward_std": None}, "reward_std=None must be a finite number"),
    ({"completion_time": float("inf")}, "completion_time=inf must be a finite number"),
    ({"response_tokens": 12}, "response_tokens=12 must be a sequence"),
    ({"image_hashes": "ab"}, "image_hashes='ab' must be a sequence"),
  ],
)
def test_bad_fields_are_named(change, message):
  with pytest.raises(ValueError, match=message):
    GroupMeta(**{**BASE, **change})


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-5, 40), max_size=60))
def test_id_set_is_a_set_of_few_ranges(ids):
  seen, want = GroupIdSet(), set()
  for i in ids:
    assert (i in seen) == (i in want)
    assert seen.add(i) == (i not in want)  # False, and no change, for an id already there
    want.add(i)
  assert all(i in seen for i in want) and not any(i in seen for i in range(-7, 43) if i not in want)
  assert len(seen) == len(want)
  ranges = seen.ranges()
  assert sorted({i for s, e in ranges for i in range(s, e)}) == sorted(want)
  # Normal form: sorted, non-empty, neither overlapping nor touching; JSON round trip.
  assert all(s < e for s, e in ranges)
  assert all(e < s for (_, e), (s, _) in zip(ranges, ranges[1:], strict=False))
  assert GroupIdSet.from_ranges(json.loads(json.dumps(ranges))) == seen


def test_id_set_stays_small_for_ids_offered_out_of_order():
  seen = GroupIdSet()
  rng = np.random.default_rng(0)
  for block in range(100):  # 64 ids at a time, completing in random order
    for i in rng.permutation(64):
      seen.add(block * 64 + int(i))
  assert seen.ranges() == [[0, 6400]]


@pytest.mark.parametrize(
  "ranges, message",
  [
    ([[3, 3]], r"range \[3, 3\] is not a \[start, end\] pair of ints with start < end"),
    ([[0, 2.5]], "is not a"),
    ([[0, 4], [4, 6]], r"range \[4, 6\] overlaps, touches or precedes \[0, 4\]"),
    ("0-4", "must be a list of"),
  ],
)
def test_id_set_refuses_bad_ranges(ranges, message):
  with pytest.raises(ValueError, match=message):
    GroupIdSet.from_ranges(ranges)


@pytest.mark.parametrize(
  "corrupt, expected",
  [
    (lambda d: d.pop("group_id"), "lacks the fields ['group_id']"),
    (lambda d: d.update(prompt_tokens=5), "field 'prompt_tokens'=5 does not decode"),
  ],
)
def test_a_malformed_group_record_is_one_sentence(corrupt, expected):
  d = GroupMeta(
    group_id=1,
    cls="a",
    gen_version=0,
    num_samples=2,
    prompt_tokens=(3, 3),
    response_tokens=(2, 2),
  ).to_dict()
  corrupt(d)
  with pytest.raises(ValueError, match=re.escape(expected)):
    GroupMeta.from_dict(d)
