"""Tests for the storage unit: validation, image dedup, backpressure, concurrency."""

import dataclasses
import queue
import random
import re
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitjax.transfer.payload import FIELD_DTYPES
from knitjax.transfer.storage import (
  GroupPayload,
  InProcessStorageUnit,
  PayloadError,
  StorageFull,
  StorageLimits,
  image_hash,
)
from knitjax.transfer.validation import REJECT_REASONS
from tests.waiting import wait_until

VOCAB, MAX_LEN = 100, 32
LIMITS = StorageLimits(
  vocab_size=VOCAB, max_seq_len=MAX_LEN, max_bytes=1 << 20, max_image_bytes=4096
)


def make_payload(rng, g=3, p=4, n=6, ref=False):
  """A valid payload already in stored form (2-D prompts, log-probs 0 off the mask)."""
  lengths = rng.integers(0, n + 1, g).astype(np.int32)
  mask = np.arange(n)[None, :] < lengths[:, None]
  payload = {
    "prompt_tokens": rng.integers(0, VOCAB, (g, p)).astype(np.int32),
    "response_tokens": rng.integers(0, VOCAB, (g, n)).astype(np.int32),
    "response_mask": mask,
    "response_lengths": lengths,
    "logprobs": np.where(mask, -rng.random((g, n)), 0).astype(np.float32),
    "rewards": rng.random(g).astype(np.float32),
  }
  if ref:
    payload["ref_logprobs"] = np.where(mask, -rng.random((g, n)), 0).astype(np.float32)
  return payload


def stored_form(payload):
  """What the unit stores for a payload from make_payload: the same plus prompt lengths."""
  out = dict(payload)
  g, p = payload["prompt_tokens"].shape
  out["prompt_lengths"] = np.full(g, p, np.int32)
  return out


def payload_bytes(payload):
  return sum(x.nbytes for x in stored_form(payload).values())


def assert_got(unit, gid, expected):
  """The unit holds ``expected`` (field -> array) for ``gid``, and no other field."""
  (got,) = unit.get([gid])
  assert isinstance(got, GroupPayload)
  for f, dtype in FIELD_DTYPES.items():
    if f not in expected:
      assert getattr(got, f) is None, f
      continue
    np.testing.assert_array_equal(getattr(got, f), expected[f], err_msg=f)
    assert getattr(got, f).dtype == dtype, f
  assert got.to_arrays().keys() == expected.keys()
  assert got.num_samples == len(expected["rewards"])
  assert got.nbytes == sum(x.nbytes for x in expected.values())


def test_round_trip_and_byte_count():
  unit = InProcessStorageUnit(LIMITS, unit_id=3)
  rng = np.random.default_rng(0)
  a, b = make_payload(rng, ref=True), make_payload(rng, g=2, p=5, n=9)
  stored = unit.put(7, a) + unit.put(8, b)
  assert stored == payload_bytes(a) + payload_bytes(b)
  assert_got(unit, 7, stored_form(a))
  assert_got(unit, 8, stored_form(b))
  got = unit.get([8, 7])  # in the order asked
  np.testing.assert_array_equal(got[0].rewards, b["rewards"])
  np.testing.assert_array_equal(got[1].response_tokens, a["response_tokens"])
  s = unit.stats()
  assert (s["unit_id"], s["groups"], s["bytes"], s["puts"], s["gets"]) == (3, 2, stored, 2, 3)
  assert s["rejected"] == dict.fromkeys(REJECT_REASONS, 0)
  assert (s["blocked_puts"], s["blocked_s"], s["full"]) == (0, 0.0, 0)
  unit.release([7, 8])
  assert unit.stats()["bytes"] == 0 and unit.stats()["releases"] == 2


def test_stored_copy_is_private_and_read_only():
  unit = InProcessStorageUnit(LIMITS)
  p = make_payload(np.random.default_rng(1))
  expected = p["response_tokens"].copy()
  unit.put(0, p)
  p["response_tokens"][:] = 0  # the writer reuses its buffer
  (got,) = unit.get([0])
  np.testing.assert_array_equal(got.response_tokens, expected)
  for name, x in got.to_arrays().items():
    assert not x.flags.writeable, name
  with pytest.raises(ValueError):
    got.response_tokens[0, 0] = 1
  with pytest.raises(dataclasses.FrozenInstanceError):
    got.rewards = np.zeros(3, np.float32)


def test_normalisation_ragged_prompts_and_derived_mask_or_lengths():
  unit = InProcessStorageUnit(LIMITS)
  prompts = [np.array([5, 6, 7], np.int32), np.array([8], np.int32)]
  common = {
    "prompt_tokens": prompts,
    "response_tokens": np.array([[1, 2, 3, 0], [4, 5, 0, 0]], np.int32),
    "logprobs": np.array([[-1, -2, -5, np.nan], [-3, -4, -np.inf, 7]], np.float32),
    "rewards": np.array([1, 0], np.float32),
  }
  unit.put(0, {**common, "response_lengths": np.array([3, 2], np.int32)})
  # A mask with a hole (e.g. a tool output inside the response) gives lengths = last on + 1.
  unit.put(1, {**common, "response_mask": np.array([[1, 0, 1, 0], [1, 1, 0, 0]], bool)})
  got = unit.get([0, 1])
  for k in range(2):
    np.testing.assert_array_equal(got[k].prompt_tokens, [[5, 6, 7], [8, 0, 0]])
    np.testing.assert_array_equal(got[k].prompt_lengths, [3, 1])
    np.testing.assert_array_equal(got[k].response_lengths, [3, 2])
  np.testing.assert_array_equal(got[0].response_mask, [[1, 1, 1, 0], [1, 1, 0, 0]])
  np.testing.assert_array_equal(got[1].response_mask, [[1, 0, 1, 0], [1, 1, 0, 0]])
  # Off-mask log-probs are stored as 0 so padding can never poison a loss.
  np.testing.assert_array_equal(got[0].logprobs, [[-1, -2, -5, 0], [-3, -4, 0, 0]])
  np.testing.assert_array_equal(got[1].logprobs, [[-1, 0, -5, 0], [-3, -4, 0, 0]])


# Each case: (mutation of a valid payload, field named, reason counted).
def _set(name, value):
  return lambda p, rng: {**p, name: value(p) if callable(value) else value}


def _poke(name, idx, value):
  def f(p, rng):
    x = p[name].copy()
    x[idx] = value
    return {**p, name: x}

  return f


def _drop(*names):
  return lambda p, rng: {k: v for k, v in p.items() if k not in names}


BAD_CASES = {
  "unknown_field": (_set("advantages", np.zeros(3, np.float32)), "advantages", "unknown_field"),
  "missing_rewards": (_drop("rewards"), "rewards", "missing_field"),
  "missing_mask_and_lengths": (
    _drop("response_mask", "response_lengths"),
    "response_mask",
    "missing_field",
  ),
  "tokens_int64": (
    _set("response_tokens", lambda p: p["response_tokens"].astype(np.int64)),
    "response_tokens",
    "dtype",
  ),
  "logprobs_float64": (
    _set("logprobs", lambda p: p["logprobs"].astype(np.float64)),
    "logprobs",
    "dtype",
  ),
  "rewards_list": (_set("rewards", [1.0, 0.0, 1.0]), "rewards", "dtype"),
  "mask_int": (
    _set("response_mask", lambda p: p["response_mask"].astype(np.int32)),
    "response_mask",
    "dtype",
  ),
  "prompt_not_array": (_set("prompt_tokens", "hello"), "prompt_tokens", "dtype"),
  "rewards_extra_sample": (_set("rewards", np.zeros(4, np.float32)), "rewards", "shape"),
  "logprobs_wider": (_set("logprobs", np.zeros((3, 7), np.float32)), "logprobs", "shape"),
  "response_fewer_samples": (
    _set("response_tokens", lambda p: p["response_tokens"][:2]),
    "response_tokens",
    "shape",
  ),
  "length_over_width": (_poke("response_lengths", 0, 7), "response_lengths", "shape"),
  "mask_past_length": (
    lambda p, rng: {
      **p,
      "response_lengths": np.array([2, 2, 2], np.int32),
      "response_mask": np.ones((3, 6), bool),
    },
    "response_mask",
    "shape",
  ),
  "empty_prompt": (
    _set("prompt_tokens", [np.zeros(0, np.int32)] + [np.ones(2, np.int32)] * 2),
    "prompt_tokens",
    "shape",
  ),
  "logprobs_nan_on_mask": (
    lambda p, rng: _poke("logprobs", (0, 0), np.nan)(
      {**p, "response_lengths": np.full(3, 6, np.int32), "response_mask": np.ones((3, 6), bool)},
      rng,
    ),
    "logprobs",
    "non_finite",
  ),
  "ref_logprobs_inf_on_mask": (
    lambda p, rng: {
      **p,
      "response_lengths": np.full(3, 6, np.int32),
      "response_mask": np.ones((3, 6), bool),
      "ref_logprobs": np.full((3, 6), -np.inf, np.float32),
    },
    "ref_logprobs",
    "non_finite",
  ),
  "rewards_nan": (_poke("rewards", 1, np.nan), "rewards", "non_finite"),
  "logprobs_positive_on_mask": (
    lambda p, rng: _poke("logprobs", (1, 2), 1e-6)(
      {**p, "response_lengths": np.full(3, 6, np.int32), "response_mask": np.ones((3, 6), bool)},
      rng,
    ),
    "logprobs",
    "value_range",
  ),
  "logprobs_inf_on_mask": (
    lambda p, rng: _poke("logprobs", (2, 0), np.inf)(
      {**p, "response_lengths": np.full(3, 6, np.int32), "response_mask": np.ones((3, 6), bool)},
      rng,
    ),
    "logprobs",
    "non_finite",
  ),
  "ref_logprobs_positive_on_mask": (
    lambda p, rng: {
      **p,
      "response_lengths": np.full(3, 6, np.int32),
      "response_mask": np.ones((3, 6), bool),
      "ref_logprobs": np.full((3, 6), 0.25, np.float32),
    },
    "ref_logprobs",
    "value_range",
  ),
  "response_token_vocab": (
    _poke("response_tokens", (2, 5), VOCAB),
    "response_tokens",
    "token_range",
  ),
  "prompt_token_negative": (_poke("prompt_tokens", (1, 0), -1), "prompt_tokens", "token_range"),
  "prompt_plus_response_too_long": (
    lambda p, rng: {
      **p,
      "prompt_tokens": np.ones((3, 30), np.int32),
      "response_lengths": np.full(3, 6, np.int32),
      "response_mask": np.ones((3, 6), bool),
    },
    "response_tokens",
    "too_long",
  ),
  "response_width_too_long": (
    lambda p, rng: {
      **p,
      "response_tokens": np.zeros((3, 40), np.int32),
      "response_mask": np.zeros((3, 40), bool),
      "response_lengths": np.zeros(3, np.int32),
      "logprobs": np.zeros((3, 40), np.float32),
    },
    "response_tokens",
    "too_long",
  ),
  "image_index_out_of_range": (
    _set("image_index", np.array([0, 0, 1], np.int32)),
    "image_index",
    "shape",
  ),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_payload_rejected_naming_the_field(case):
  mutate, field, reason = BAD_CASES[case]
  unit = InProcessStorageUnit(LIMITS)
  rng = np.random.default_rng(2)
  bad = mutate(make_payload(rng), rng)
  images = [np.zeros((4, 4), np.uint8)] if "image_index" in bad else []
  with pytest.raises(PayloadError) as err:
    unit.put(11, bad, images)
  assert (err.value.field, err.value.reason, err.value.group_id) == (field, reason, 11)
  assert str(err.value).startswith(f"group 11: field '{field}' ")
  assert "accepted: " in str(err.value)  # says what would be accepted
  s = unit.stats()
  assert s["rejected"][reason] == 1 and sum(s["rejected"].values()) == 1
  assert (s["groups"], s["bytes"], s["images"], s["puts"]) == (0, 0, 0, 0)
  with pytest.raises(KeyError, match=r"groups \[11\] are not held"):
    unit.get([11])


@pytest.mark.parametrize(
  "images, field, reason",
  [
    ([np.zeros((4, 4), np.int64)], "images[0]", "dtype"),
    ([np.zeros((4, 4), np.uint8), np.zeros((4,), np.uint8)], "images[1]", "shape"),
    ([np.zeros((64, 64, 3), np.uint8)], "images[0]", "too_large"),
    ([np.full((2, 2), np.nan, np.float32)], "images[0]", "non_finite"),
  ],
)
def test_bad_image_rejected(images, field, reason):
  unit = InProcessStorageUnit(LIMITS)
  with pytest.raises(PayloadError, match=re.escape(f"field '{field}'")) as err:
    unit.put(1, make_payload(np.random.default_rng(3)), images)
  assert err.value.reason == reason
  assert unit.stats()["rejected"][reason] == 1 and unit.stats()["images"] == 0


def test_payload_larger_than_budget_and_duplicate_id_rejected():
  rng = np.random.default_rng(4)
  p = make_payload(rng)
  small = InProcessStorageUnit(
    StorageLimits(vocab_size=VOCAB, max_seq_len=MAX_LEN, max_bytes=payload_bytes(p) - 1)
  )
  with pytest.raises(PayloadError, match="max_bytes") as err:
    small.put(0, p)
  assert err.value.reason == "too_large" and small.stats()["rejected"]["too_large"] == 1
  unit = InProcessStorageUnit(LIMITS)
  unit.put(5, p)
  with pytest.raises(PayloadError, match="field 'group_id' is already held") as err:
    unit.put(5, make_payload(rng))
  assert err.value.reason == "duplicate"
  assert_got(unit, 5, stored_form(p))  # the first one is untouched
  assert unit.stats()["rejected"]["duplicate"] == 1 and unit.stats()["groups"] == 1
  unit.release([5])
  unit.put(5, p)  # a released id may come back
  with pytest.raises(PayloadError, match="field 'group_id' is not an int") as err:
    unit.put("6", p)
  assert err.value.reason == "dtype"


@st.composite
def payload_and_corruption(draw):
  seed = draw(st.integers(0, 2**32 - 1))
  g, p, n = draw(st.integers(1, 4)), draw(st.integers(1, 8)), draw(st.integers(1, 8))
  kind = draw(st.sampled_from(["none", "dtype", "shape", "non_finite", "token_range", "unknown"]))
  return np.random.default_rng(seed), g, p, n, kind


@settings(max_examples=60, deadline=None)
@given(payload_and_corruption())
def test_property_valid_stored_exactly_corrupt_never_stored(args):
  rng, g, p, n, kind = args
  unit = InProcessStorageUnit(LIMITS)
  payload = make_payload(rng, g, p, n, ref=bool(rng.integers(2)))
  field = str(rng.choice([f for f in payload if f not in ("response_mask", "response_lengths")]))
  bad = dict(payload)
  if kind == "dtype":
    bad[field] = payload[field].astype(np.float64 if payload[field].dtype == np.int32 else np.int32)
  elif kind == "shape":  # an extra axis, or one sample too many (G is set by the prompts)
    x = payload[field]
    bad[field] = x[..., None] if field == "prompt_tokens" else np.concatenate([x, x[:1]])
  elif kind == "non_finite":
    field = "logprobs" if payload["response_lengths"].any() else "rewards"
    x = payload[field].copy()
    x[tuple(np.argwhere(payload["response_mask"])[0]) if field == "logprobs" else 0] = np.nan
    bad[field] = x
  elif kind == "token_range":
    field = str(rng.choice(["prompt_tokens", "response_tokens"]))
    x = payload[field].copy()
    x.flat[rng.integers(x.size)] = rng.choice([-1, VOCAB, VOCAB + 5])
    bad[field] = x
  elif kind == "unknown":
    field = "values"
    bad[field] = np.zeros(g, np.float32)
  if kind == "none":
    unit.put(0, payload)
    assert_got(unit, 0, stored_form(payload))
    unit.release([0])
  else:
    with pytest.raises(PayloadError) as err:
      unit.put(0, bad)
    assert err.value.field == field and f"'{field}'" in str(err.value)
    assert unit.stats()["rejected"][err.value.reason] == 1
  assert unit.stats()["groups"] == 0 and unit.stats()["bytes"] == 0


def test_image_dedup_by_hash_with_refcounts():
  unit = InProcessStorageUnit(LIMITS)
  rng = np.random.default_rng(5)
  img_a = rng.integers(0, 255, (8, 8, 3)).astype(np.uint8)
  img_b = rng.random((4, 4)).astype(np.float32)
  p1, p2 = make_payload(rng), make_payload(rng)
  p2["image_index"] = np.array([0, 1, 0], np.int32)
  n1 = unit.put(1, p1, [img_a, img_a.copy()])  # the same image twice is stored once
  n2 = unit.put(2, p2, [img_a.copy(), img_b])
  assert n1 == payload_bytes(p1) + img_a.nbytes
  assert n2 == payload_bytes(p2) + img_b.nbytes  # only img_b is new
  s = unit.stats()
  assert (s["images"], s["image_refs"], s["image_dedup_hits"]) == (2, 3, 1)
  assert s["image_bytes"] == img_a.nbytes + img_b.nbytes
  assert s["bytes"] == n1 + n2
  ha, hb = image_hash(img_a), image_hash(img_b)
  got = unit.get_images([hb, ha])
  np.testing.assert_array_equal(got[0], img_b)
  np.testing.assert_array_equal(got[1], img_a)
  np.testing.assert_array_equal(unit.get([2])[0].image_index, [0, 1, 0])
  assert unit.get([1])[0].image_index is None
  unit.release([1])
  s = unit.stats()
  assert (s["images"], s["image_refs"]) == (2, 2)  # group 2 still uses img_a
  np.testing.assert_array_equal(unit.get_images([ha])[0], img_a)
  unit.release([2])
  s = unit.stats()
  assert (s["images"], s["image_refs"], s["image_bytes"], s["bytes"]) == (0, 0, 0, 0)
  with pytest.raises(KeyError):
    unit.get_images([ha])


def test_image_hash_covers_dtype_and_shape():
  x = np.arange(12, dtype=np.uint8)
  assert image_hash(x.reshape(3, 4)) == image_hash(x.reshape(3, 4).copy())
  assert image_hash(x.reshape(3, 4)) != image_hash(x.reshape(4, 3))
  assert image_hash(np.zeros((2, 2), np.float32)) != image_hash(np.zeros((2, 4), np.float16))
  assert image_hash(x.reshape(3, 4).T) == image_hash(np.ascontiguousarray(x.reshape(3, 4).T))
  assert len(image_hash(x.reshape(3, 4))) == 64


def _budget_for(n_groups, payload):
  return StorageLimits(
    vocab_size=VOCAB, max_seq_len=MAX_LEN, max_bytes=n_groups * payload_bytes(payload), timeout_s=5
  )


def test_backpressure_blocks_writer_until_release():
  rng = np.random.default_rng(6)
  payloads = [make_payload(rng) for _ in range(3)]
  unit = InProcessStorageUnit(_budget_for(2, payloads[0]))
  unit.put(0, payloads[0])
  unit.put(1, payloads[1])
  done = threading.Event()
  writer = threading.Thread(target=lambda: (unit.put(2, payloads[2]), done.set()))
  writer.start()
  assert not done.wait(0.3)  # blocked: the budget holds two groups
  s = unit.stats()
  assert (s["groups"], s["waiting"]) == (2, 1) and s["bytes"] <= s["max_bytes"]
  with pytest.raises(PayloadError, match="already held"):  # a waiting id is taken
    unit.put(2, payloads[2])
  unit.release([0])
  assert done.wait(1)  # woken by the release, not by its 5 s timeout
  writer.join()
  s = unit.stats()
  assert (s["groups"], s["bytes"], s["waiting"]) == (2, s["max_bytes"], 0)
  # it waited (how long depends on when its thread started, so no timing bound here)
  assert s["blocked_puts"] == 1 and s["blocked_s"] > 0
  assert_got(unit, 2, stored_form(payloads[2]))


def test_backpressure_raise_mode_and_timeout():
  rng = np.random.default_rng(7)
  p = make_payload(rng)
  limits = _budget_for(1, p)
  unit = InProcessStorageUnit(dataclasses.replace(limits, on_full="raise"))
  unit.put(0, p)
  with pytest.raises(StorageFull, match="storage unit 0 is full: group 1"):
    unit.put(1, p)
  # raised at once: it never waited (a counter, not a clock: CI machines are loaded)
  assert unit.stats()["blocked_puts"] == 0 and unit.stats()["blocked_s"] == 0
  assert unit.stats()["full"] == 1 and unit.stats()["groups"] == 1
  unit.release([0])
  unit.put(1, p)  # room again; the failed id was not kept
  blocking = InProcessStorageUnit(dataclasses.replace(limits, timeout_s=0.2))
  blocking.put(0, p)
  start = time.monotonic()
  with pytest.raises(StorageFull, match="after waiting 0.2 s"):
    blocking.put(1, p)
  assert time.monotonic() - start >= 0.2  # it waited its timeout (a lower bound is never flaky)
  assert blocking.stats()["blocked_puts"] == 1
  assert blocking.stats()["waiting"] == 0 and blocking.stats()["groups"] == 1


def test_waiting_writers_are_served_in_order():
  rng = np.random.default_rng(8)
  small = make_payload(rng, g=2)
  big = {k: np.concatenate([v, v]) for k, v in small.items()}  # exactly twice the bytes
  unit = InProcessStorageUnit(_budget_for(2, small))
  unit.put(0, small)
  unit.put(1, small)
  order = []
  t_big = threading.Thread(target=lambda: (unit.put(10, big), order.append(10)))
  t_big.start()
  wait_until(lambda: unit.stats()["waiting"] == 1, what="the big put waiting")
  t_small = threading.Thread(target=lambda: (unit.put(11, small), order.append(11)))
  t_small.start()
  wait_until(lambda: unit.stats()["waiting"] == 2, what="both puts waiting")
  unit.release([0])  # room for the small one, but the big one came first
  # A negative check: give a wrongly woken small put a moment to get in. It can only miss a
  # bug on a slow machine, never fail a correct unit.
  threading.Event().wait(0.2)
  assert order == [] and unit.stats()["waiting"] == 2
  unit.release([1])
  t_big.join(5)
  assert order == [10]
  unit.release([10])
  t_small.join(5)
  assert order == [10, 11]


def test_writer_timing_out_at_the_head_lets_the_next_one_in():
  rng = np.random.default_rng(11)
  small = make_payload(rng, g=2)
  big = {k: np.concatenate([v, v]) for k, v in small.items()}
  limits = _budget_for(2, small)
  # A put reads the unit's limits when it starts: the big put at the head of the queue gives up
  # after 0.3 s, the small one behind it would wait 60 s. Only the order is checked, no clock.
  unit = InProcessStorageUnit(dataclasses.replace(limits, timeout_s=0.3))
  unit.put(0, small)
  events = []

  def put_big():
    with pytest.raises(StorageFull, match="after waiting 0.3 s"):
      unit.put(10, big)
    events.append("big gave up")

  t_big = threading.Thread(target=put_big)
  t_big.start()
  wait_until(lambda: unit.stats()["waiting"] == 1, what="the big put waiting")
  unit.limits = dataclasses.replace(limits, timeout_s=60.0)
  t_small = threading.Thread(target=lambda: (unit.put(11, small), events.append("small in")))
  t_small.start()
  t_big.join(60)
  t_small.join(60)
  # The small put fitted all along but waited behind the head; it got in once the head left.
  assert events == ["big gave up", "small in"]
  s = unit.stats()
  assert (s["groups"], s["full"], s["waiting"], s["blocked_puts"]) == (2, 1, 0, 2)


def test_get_errors_change_nothing_and_release_is_idempotent():
  unit = InProcessStorageUnit(LIMITS)
  rng = np.random.default_rng(9)
  p = make_payload(rng)
  unit.put(0, p)
  assert unit.get([0])[0].ref_logprobs is None  # put without the optional field
  with pytest.raises(KeyError, match=r"groups \[3\] are not held by storage unit 0"):
    unit.get([0, 3])
  assert unit.stats()["gets"] == 1  # the failed get counts nothing
  # Releasing ids that are not held (never put, already released, lost with a crashed rollout
  # actor) skips them; the held ones in the same call are still released.
  q = make_payload(rng)
  unit.put(1, q, [np.ones((2, 2), np.uint8)])
  unit.release([3])
  assert (unit.stats()["groups"], unit.stats()["releases"], unit.stats()["release_misses"]) == (
    2,
    0,
    1,
  )
  unit.release([0, 3, 0])
  s = unit.stats()
  assert (s["groups"], s["releases"], s["release_misses"]) == (1, 1, 3)
  assert s["bytes"] == payload_bytes(q) + 4  # group 1 and its image remain
  unit.release([1, 1])
  s = unit.stats()
  assert (s["groups"], s["bytes"], s["images"], s["image_refs"]) == (0, 0, 0, 0)
  assert (s["releases"], s["release_misses"]) == (2, 4)
  unit.put(3, p)  # an id released before it was put is stored normally
  assert_got(unit, 3, stored_form(p))


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"vocab_size": 0}, "vocab_size is 0"),
    ({"max_bytes": 1.5}, "max_bytes is 1.5"),
    ({"on_full": "drop"}, "on_full is 'drop'"),
    ({"timeout_s": -1}, "timeout_s is -1"),
  ],
)
def test_limits_validation(kwargs, match):
  base = {"vocab_size": VOCAB, "max_seq_len": MAX_LEN, "max_bytes": 100}
  with pytest.raises(ValueError, match=match):
    StorageLimits(**{**base, **kwargs})


def test_concurrent_put_get_release_loses_nothing():
  writers, per_writer, readers = 4, 100, 3
  rng = np.random.default_rng(10)
  images = [rng.integers(0, 255, (6, 6, 3)).astype(np.uint8) for _ in range(3)]
  biggest = payload_bytes(make_payload(rng, g=4, p=8, n=12))
  # Room for a few groups only, so writers block on readers all the time.
  limits = StorageLimits(
    vocab_size=VOCAB, max_seq_len=MAX_LEN, max_bytes=4 * biggest + 3 * images[0].nbytes
  )
  unit = InProcessStorageUnit(limits)
  expected, ready, errors, got_count, peak = {}, queue.Queue(), [], {}, [0]
  lock = threading.Lock()

  def write(w):
    wrng = np.random.default_rng(100 + w)
    for k in range(per_writer):
      gid = w * 1000 + k
      payload = make_payload(
        wrng, g=int(wrng.integers(1, 5)), p=int(wrng.integers(1, 9)), n=int(wrng.integers(1, 13))
      )
      used = [images[i] for i in wrng.choice(3, int(wrng.integers(0, 3)), replace=False)]
      with lock:
        expected[gid] = (stored_form(payload), [image_hash(im) for im in used])
      unit.put(gid, payload, used)
      ready.put(gid)

  def read():
    rrng = random.Random(threading.get_ident())
    while True:
      batch = [ready.get()]
      if batch[0] is None:
        return
      while rrng.random() < 0.5 and not ready.empty():  # sometimes several groups at once
        nxt = ready.get()
        if nxt is None:
          ready.put(None)
          break
        batch.append(nxt)
      try:
        got = unit.get(batch)
        for k, gid in enumerate(batch):
          want, hashes = expected[gid]
          assert got[k].to_arrays().keys() == want.keys()
          for f, x in want.items():  # every stored field
            np.testing.assert_array_equal(getattr(got[k], f), x)
          for im, h in zip(unit.get_images(hashes), hashes, strict=True):
            assert image_hash(im) == h
        with lock:
          for gid in batch:
            got_count[gid] = got_count.get(gid, 0) + 1
          peak[0] = max(peak[0], unit.stats()["bytes"])
        unit.release(batch)
      except Exception as e:  # noqa: BLE001 - surfaced by the main thread
        errors.append(e)
        return

  def monitor():
    while not writers_done.is_set():
      bytes_now = unit.stats()["bytes"]
      with lock:
        peak[0] = max(peak[0], bytes_now)
      time.sleep(0.001)

  writers_done = threading.Event()
  threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
  threads += [threading.Thread(target=read) for _ in range(readers)]
  threads.append(threading.Thread(target=monitor))
  for t in threads:
    t.start()
  for t in threads[:writers]:
    t.join(60)
  writers_done.set()
  threads[-1].join()
  for _ in range(readers):
    ready.put(None)
  for t in threads[writers:-1]:
    t.join(60)
  assert not errors, errors[0]
  total = writers * per_writer
  assert got_count == dict.fromkeys(expected, 1) and len(expected) == total
  assert peak[0] <= limits.max_bytes
  s = unit.stats()
  assert (s["groups"], s["bytes"], s["images"], s["image_refs"], s["waiting"]) == (0, 0, 0, 0, 0)
  assert s["puts"] == s["releases"] == total
  assert s["blocked_puts"] > 0 and s["blocked_s"] > 0  # the budget really pushed back
