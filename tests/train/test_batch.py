"""Trainer batch layout: vectorised make_batch equals the per-row construction, honours masks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitjax.train.batch import ROW_FIELDS, make_batch, pad_rows

P, N, PAD = 5, 6, 0


def reference_batch(prompts, responses, logps, advantages, *, prompt_len, max_new_tokens, pad_id):
  """The per-row construction make_batch replaced (every response token carries loss)."""
  rows, t = len(prompts), prompt_len + max_new_tokens
  tokens = np.full((rows, t), pad_id, np.int32)
  valid = np.zeros((rows, t), bool)
  loss_mask = np.zeros((rows, t), np.float32)
  behavior = np.zeros((rows, t), np.float32)
  for i, (p, r, lp) in enumerate(zip(prompts, responses, logps, strict=True)):
    n = len(r)
    tokens[i, prompt_len - len(p) : prompt_len] = p
    tokens[i, prompt_len : prompt_len + n] = r
    valid[i, prompt_len - len(p) : prompt_len + n] = True
    loss_mask[i, prompt_len - 1 : prompt_len - 1 + n] = 1.0
    behavior[i, prompt_len - 1 : prompt_len - 1 + n] = lp
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
  targets = np.concatenate([tokens[:, 1:], np.full((rows, 1), pad_id, np.int32)], axis=1)
  return {
    "tokens": tokens,
    "positions": positions,
    "valid": valid,
    "targets": targets,
    "loss_mask": loss_mask,
    "behavior_logp": behavior,
    "advantages": np.asarray(advantages, np.float32),
    "rewards": np.zeros(rows, np.float32),  # make_batch's defaults: no rewards, a group per row
    "group_id": np.arange(rows, dtype=np.int32),
  }


def ragged(rng, rows, min_prompt=1):
  prompts = [
    rng.integers(3, 32, rng.integers(min_prompt, P + 1)).astype(np.int32) for _ in range(rows)
  ]
  lens = rng.integers(0, N + 1, rows)
  responses = [rng.integers(3, 32, n).astype(np.int32) for n in lens]
  logps = [rng.normal(-3.0, 0.5, n).astype(np.float32) for n in lens]
  return prompts, responses, logps, rng.normal(size=rows).astype(np.float32)


def assert_batches_equal(got, want):
  assert got.keys() == want.keys()
  for k in want:
    assert got[k].dtype == want[k].dtype, k
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 9), st.integers(0, 3), st.integers(0, 3))
def test_property_equals_the_per_row_construction(seed, rows, extra_p, extra_n):
  """Unmasked rows, with arbitrary junk past the lengths and wider arrays, lay out as before."""
  rng = np.random.default_rng(seed)
  prompts, responses, logps, adv = ragged(rng, rows, min_prompt=0)
  packed = pad_rows(prompts, responses, logps)
  # Wider arrays with junk past each length must not leak into the batch.
  wide = {}
  for name, x in packed.items():
    if x.ndim == 2:
      extra = extra_p if name == "prompt_tokens" else extra_n
      x = np.pad(x, ((0, 0), (0, extra)))
      width = np.arange(x.shape[1])[None]
      length = packed["prompt_lengths" if name == "prompt_tokens" else "response_lengths"]
      junk = rng.integers(1, 9, x.shape).astype(x.dtype) if x.dtype != bool else False
      x = np.where(width < length[:, None], x, junk)
    wide[name] = x
  layout = dict(prompt_len=P, max_new_tokens=N, pad_id=PAD)
  want = reference_batch(prompts, responses, logps, adv, **layout)
  assert_batches_equal(make_batch(packed, adv, **layout), want)
  assert_batches_equal(make_batch(wide, adv, **layout), want)


def test_hole_in_the_mask_carries_no_loss_but_stays_in_the_sequence():
  prompts = [np.array([5, 6], np.int32), np.array([7], np.int32)]
  responses = [np.array([10, 11, 12, 13], np.int32), np.array([14, 15], np.int32)]
  logps = [np.array([-1, -2, -3, -4], np.float32), np.array([-5, -6], np.float32)]
  adv = np.array([1.0, -1.0], np.float32)
  rows = pad_rows(prompts, responses, logps)
  rows["response_mask"] = rows["response_mask"].copy()
  rows["response_mask"][0, 1:3] = False  # tool output inside row 0's response
  got = make_batch(rows, adv, prompt_len=3, max_new_tokens=4, pad_id=PAD)
  want = reference_batch(prompts, responses, logps, adv, prompt_len=3, max_new_tokens=4, pad_id=PAD)
  # Position prompt_len - 1 + k predicts response token k: k = 1, 2 are columns 3, 4.
  np.testing.assert_array_equal(got["loss_mask"][0], [0, 0, 1, 0, 0, 1, 0])
  np.testing.assert_array_equal(got["behavior_logp"][0], [0, 0, -1, 0, 0, -4, 0])
  np.testing.assert_array_equal(got["tokens"][0], [0, 5, 6, 10, 11, 12, 13])
  np.testing.assert_array_equal(got["valid"][0], [0, 1, 1, 1, 1, 1, 1])
  # Everything else is what the per-row construction gives.
  for k in ("tokens", "positions", "valid", "targets", "advantages"):
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  for k in ("loss_mask", "behavior_logp"):
    np.testing.assert_array_equal(got[k][1], want[k][1], err_msg=k)
    hole = np.zeros(7, bool)
    hole[3:5] = True
    np.testing.assert_array_equal(got[k][0][~hole], want[k][0][~hole], err_msg=k)


def test_masked_off_logprobs_never_reach_the_batch():
  rows = pad_rows(
    [np.array([1], np.int32)], [np.array([2, 3], np.int32)], [np.zeros(2, np.float32)]
  )
  rows["logprobs"] = np.array([[np.nan, -1.0]], np.float32)
  rows["response_mask"] = np.array([[False, True]])
  got = make_batch(rows, np.zeros(1), prompt_len=1, max_new_tokens=2, pad_id=PAD)
  np.testing.assert_array_equal(got["behavior_logp"], [[0.0, -1.0, 0.0]])
  np.testing.assert_array_equal(got["loss_mask"], [[0.0, 1.0, 0.0]])


def test_response_width_wider_than_max_new_tokens_is_cut_when_lengths_fit():
  rows = pad_rows(
    [np.array([4], np.int32)] * 2, [np.array([5, 6], np.int32)] * 2, [np.ones(2, np.float32)] * 2
  )
  wide = {
    k: (np.pad(v, ((0, 0), (0, 3))) if v.ndim == 2 and k != "prompt_tokens" else v)
    for k, v in rows.items()
  }
  got = make_batch(wide, np.zeros(2), prompt_len=1, max_new_tokens=2, pad_id=PAD)
  assert got["tokens"].shape == (2, 3)
  np.testing.assert_array_equal(got["tokens"], [[4, 5, 6]] * 2)


@pytest.mark.parametrize(
  "change, match",
  [
    (
      lambda r: {**r, "response_lengths": np.array([3, 7], np.int32)},
      r"row 1: response length 7 is outside \[0, 6\]",
    ),
    (
      lambda r: {**r, "prompt_tokens": r["prompt_tokens"][:, :1]},
      r"row 0: prompt length 2 is outside \[0, 1\]",
    ),
    (lambda r: {**r, "logprobs": r["logprobs"][:, :3]}, r"logprobs has shape \[2, 3\]"),
    (lambda r: {**r, "response_mask": r["response_mask"][:1]}, r"response_mask has shape \[1, 6\]"),
    (lambda r: {k: v for k, v in r.items() if k != "response_mask"}, r"lack \['response_mask'\]"),
  ],
)
def test_bad_rows_raise_one_sentence(change, match):
  rows = pad_rows(
    [np.array([1, 2], np.int32), np.array([3], np.int32)],
    [np.arange(6, dtype=np.int32), np.arange(3, dtype=np.int32)],
    [np.zeros(6, np.float32), np.zeros(3, np.float32)],
  )
  with pytest.raises(ValueError, match=match):
    make_batch(change(rows), np.zeros(2), prompt_len=P, max_new_tokens=N, pad_id=PAD)


def test_prompt_or_response_that_does_not_fit_is_named():
  rows = pad_rows(
    [np.arange(1, 4, dtype=np.int32), np.arange(1, 7, dtype=np.int32)],
    [np.arange(2, dtype=np.int32), np.arange(5, dtype=np.int32)],
    [np.zeros(2, np.float32), np.zeros(5, np.float32)],
  )
  with pytest.raises(ValueError, match=r"^row 1: prompt of 6 tokens does not fit prompt_len=5\.$"):
    make_batch(rows, np.zeros(2), prompt_len=5, max_new_tokens=5, pad_id=PAD)
  with pytest.raises(
    ValueError, match=r"^row 1: response of 5 tokens does not fit max_new_tokens=4\.$"
  ):
    make_batch(rows, np.zeros(2), prompt_len=6, max_new_tokens=4, pad_id=PAD)


def test_pad_rows_pads_right_and_checks_logprob_counts():
  rows = pad_rows(
    [np.array([7, 8], np.int32), np.array([9], np.int32)],
    [np.array([1, 2, 3], np.int32), np.zeros(0, np.int32)],
    [np.array([-1, -2, -3], np.float32), np.zeros(0, np.float32)],
  )
  assert tuple(rows) == ROW_FIELDS
  np.testing.assert_array_equal(rows["prompt_tokens"], [[7, 8], [9, 0]])
  np.testing.assert_array_equal(rows["prompt_lengths"], [2, 1])
  np.testing.assert_array_equal(rows["response_tokens"], [[1, 2, 3], [0, 0, 0]])
  np.testing.assert_array_equal(rows["response_mask"], [[1, 1, 1], [0, 0, 0]])
  np.testing.assert_array_equal(rows["response_lengths"], [3, 0])
  np.testing.assert_array_equal(rows["logprobs"], [[-1, -2, -3], [0, 0, 0]])
  with pytest.raises(ValueError, match="row 0 has 2 log-probs for 3 response tokens"):
    pad_rows([np.ones(1, np.int32)], [np.ones(3, np.int32)], [np.ones(2, np.float32)])


def test_rewards_and_group_ids_travel_with_the_rows():
  prompts, responses, logps, adv = ragged(np.random.default_rng(3), 4)
  got = make_batch(
    pad_rows(prompts, responses, logps), adv, prompt_len=P, max_new_tokens=N, pad_id=PAD,
    rewards=[1, 0, 0.5, 2], group_ids=[7, 7, 3, 3],
  )  # fmt: skip
  np.testing.assert_array_equal(got["rewards"], np.array([1, 0, 0.5, 2], np.float32))
  np.testing.assert_array_equal(got["group_id"], np.array([7, 7, 3, 3], np.int32))
