"""GroupMeta validation and round trip."""

import numpy as np
import pytest

from knitjax.transfer.group import GroupMeta

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
    ({"reward_mean": float("nan")}, "reward_mean=nan must be finite"),
    ({"storage_unit": -2}, "storage_unit=-2"),
    ({"image_hashes": ("",)}, "image_hashes"),
    ({"group_id": "7"}, "group_id='7'"),
  ],
)
def test_bad_fields_are_named(change, message):
  with pytest.raises(ValueError, match=message):
    GroupMeta(**{**BASE, **change})
