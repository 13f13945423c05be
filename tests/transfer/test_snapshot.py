"""Payload snapshots for checkpoints: every field, holed masks and images survive the round trip."""

import base64
import io
import json

import numpy as np
import pytest

from knitjax.transfer.group import GroupMeta
from knitjax.transfer.payload import FIELD_DTYPES
from knitjax.transfer.snapshot import restore_groups, snapshot_groups
from knitjax.transfer.storage import InProcessStorageUnit, StorageLimits, image_hash

LIMITS = StorageLimits(vocab_size=64, max_seq_len=16, max_bytes=1 << 20, max_image_bytes=1 << 12)


def _units():
  return {u: InProcessStorageUnit(LIMITS, unit_id=u) for u in (0, 1)}


def _meta(gid, unit, g, images=()):
  return GroupMeta(
    group_id=gid,
    cls="a",
    gen_version=0,
    num_samples=g,
    prompt_tokens=(1,) * g,
    response_tokens=(1,) * g,
    storage_unit=unit,
    image_hashes=tuple(image_hash(im) for im in images),
  )


def _fill(units, rng):
  """Three groups on two units: a holed mask with ref log-probs, images shared across units."""
  img_a = rng.integers(0, 255, (4, 4, 3)).astype(np.uint8)
  img_b = rng.random((3, 5)).astype(np.float32)
  holed = {
    "prompt_tokens": [np.array([5, 6, 7], np.int32), np.array([8], np.int32)],
    "response_tokens": rng.integers(1, 64, (2, 5)).astype(np.int32),
    "response_mask": np.array([[1, 0, 0, 1, 0], [1, 1, 1, 1, 1]], bool),
    "response_lengths": np.array([5, 5], np.int32),  # row 0 ends on an unmasked tool token
    "logprobs": -np.abs(rng.normal(2, 1, (2, 5))).astype(np.float32),
    "ref_logprobs": -np.abs(rng.normal(2, 1, (2, 5))).astype(np.float32),
    "rewards": np.array([1, 0], np.float32),
    "image_index": np.array([1, 0], np.int32),
  }
  images0 = [img_b, img_a]  # image_index counts in this order
  plain = {
    "prompt_tokens": rng.integers(1, 64, (3, 2)).astype(np.int32),
    "response_tokens": rng.integers(1, 64, (3, 4)).astype(np.int32),
    "response_lengths": np.array([4, 1, 0], np.int32),
    "logprobs": -np.abs(rng.normal(2, 1, (3, 4))).astype(np.float32),
    "rewards": np.array([0, 0, 1], np.float32),
  }
  shared = {**plain, "image_index": np.zeros(3, np.int32)}
  units[0].put(10, holed, images0)
  units[1].put(11, plain)
  units[1].put(12, shared, [img_a.copy()])
  metas = [_meta(10, 0, 2, images0), _meta(11, 1, 3), _meta(12, 1, 3, [img_a])]
  return metas, {image_hash(img_a): img_a, image_hash(img_b): img_b}


def test_round_trip_keeps_every_field_the_holed_mask_and_the_images():
  rng = np.random.default_rng(0)
  units = _units()
  metas, images = _fill(units, rng)
  before = {m.group_id: units[m.storage_unit].get([m.group_id])[0] for m in metas}
  snap = json.loads(json.dumps(snapshot_groups(units, metas)))  # JSON-able, as in a checkpoint
  assert [g["group_id"] for g in snap["groups"]] == [10, 11, 12]
  with np.load(io.BytesIO(base64.b64decode(snap["npz"]))) as data:
    assert sorted(k for k in data.files if k.startswith("image/")) == sorted(
      f"image/{h}" for h in images
    )  # img_a, used on both units, is kept once

  fresh = _units()
  assert restore_groups(fresh, snap) == 3
  for m in metas:
    (got,) = fresh[m.storage_unit].get([m.group_id])
    want = before[m.group_id]
    for name in FIELD_DTYPES:
      x, y = getattr(want, name), getattr(got, name)
      assert (x is None) == (y is None), (m.group_id, name)
      if x is not None:
        np.testing.assert_array_equal(y, x, err_msg=f"{m.group_id}/{name}")
        assert y.dtype == x.dtype
    # Each sample's image is the same image as before the checkpoint.
    if m.image_hashes:
      for k in range(m.num_samples):
        h = m.image_hashes[int(got.image_index[k])]
        np.testing.assert_array_equal(fresh[m.storage_unit].get_images([h])[0], images[h])
  np.testing.assert_array_equal(fresh[0].get([10])[0].response_mask[0], [1, 0, 0, 1, 0])
  np.testing.assert_array_equal(fresh[0].get([10])[0].response_lengths, [5, 5])
  s0, s1 = fresh[0].stats(), fresh[1].stats()
  assert (s0["groups"], s0["images"], s1["groups"], s1["images"]) == (1, 2, 2, 1)
  assert (s0["bytes"], s1["bytes"]) == (units[0].stats()["bytes"], units[1].stats()["bytes"])


def test_only_the_named_groups_and_their_images_are_kept():
  units = _units()
  metas, images = _fill(units, np.random.default_rng(1))
  snap = snapshot_groups(units, [metas[1]])
  fresh = _units()
  assert restore_groups(fresh, snap) == 1
  assert fresh[0].stats()["groups"] == 0 and fresh[1].stats()["groups"] == 1
  assert fresh[1].stats()["images"] == 0
  assert restore_groups(_units(), snapshot_groups(units, [])) == 0


def test_bad_snapshots_and_requests_raise_one_sentence():
  units = _units()
  metas, _ = _fill(units, np.random.default_rng(2))
  with pytest.raises(ValueError, match="repeated group ids"):
    snapshot_groups(units, [metas[0], metas[0]])
  with pytest.raises(ValueError, match="older checkpoint format"):
    restore_groups(units, {"group_ids": [1], "npz": ""})
  with pytest.raises(KeyError, match=r"storage units \[1\] that are not given"):
    restore_groups({0: units[0]}, snapshot_groups(units, metas))
