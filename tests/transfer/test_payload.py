"""GroupPayload: the one field list, validation of built payloads, arrays round trip, stack_rows."""

import dataclasses
import pickle

import numpy as np
import pytest

from knitjax.transfer.payload import (
  FIELD_DTYPES,
  INPUT_FIELDS,
  REQUIRED_FIELDS,
  GroupPayload,
  stack_rows,
)
from knitjax.transfer.validation import PayloadError, validate_payload

VOCAB, MAX_LEN = 50, 32
CHECK = dict(vocab_size=VOCAB, max_seq_len=MAX_LEN)


def _input(prompts, mask, *, ref=False, image_index=None, seed=0):
  """An input payload with ragged prompts and the given response mask (log-probs -1 - position)."""
  rng = np.random.default_rng(seed)
  mask = np.asarray(mask, bool)
  g, n = mask.shape
  out = {
    "prompt_tokens": [np.asarray(p, np.int32) for p in prompts],
    "response_tokens": rng.integers(1, VOCAB, (g, n)).astype(np.int32),
    "response_mask": mask,
    "logprobs": np.broadcast_to(-1.0 - np.arange(n, dtype=np.float32), (g, n)).copy(),
    "rewards": np.arange(g, dtype=np.float32),
  }
  if ref:
    out["ref_logprobs"] = np.full((g, n), -0.5, np.float32)
  if image_index is not None:
    out["image_index"] = np.asarray(image_index, np.int32)
  return out


def test_the_field_list_comes_from_the_dataclass():
  names = [f.name for f in dataclasses.fields(GroupPayload)]
  assert list(FIELD_DTYPES) == names
  assert tuple(n for n in names if n != "prompt_lengths") == INPUT_FIELDS
  assert REQUIRED_FIELDS == ("prompt_tokens", "response_tokens", "logprobs", "rewards")
  assert FIELD_DTYPES["response_mask"] == np.bool_ and FIELD_DTYPES["image_index"] == np.int32


def test_validate_returns_a_payload_and_accepts_it_again_unchanged():
  mask = [[1, 0, 1, 0], [1, 1, 0, 0]]  # a hole in sample 0
  built = validate_payload(
    3, _input([[5, 6, 7], [8]], mask, ref=True, image_index=[0, 1]), 2, **CHECK
  )
  assert isinstance(built, GroupPayload)
  assert (built.num_samples, built.ref_logprobs.shape, built.image_index.tolist()) == (
    2,
    (2, 4),
    [0, 1],
  )
  np.testing.assert_array_equal(built.prompt_tokens, [[5, 6, 7], [8, 0, 0]])
  np.testing.assert_array_equal(built.prompt_lengths, [3, 1])
  np.testing.assert_array_equal(built.response_lengths, [3, 2])
  np.testing.assert_array_equal(built.logprobs, [[-1, 0, -3, 0], [-1, -2, 0, 0]])
  assert built.nbytes == sum(x.nbytes for x in built.to_arrays().values())
  again = validate_payload(3, built, 2, **CHECK)
  assert again is not built
  for name, x in built.to_arrays().items():
    np.testing.assert_array_equal(getattr(again, name), x, err_msg=name)
    assert getattr(again, name).dtype == x.dtype and not getattr(again, name).flags.writeable


def test_a_built_payload_is_checked_like_a_mapping():
  good = validate_payload(0, _input([[5, 6], [7, 8]], [[1, 1], [1, 0]]), 0, **CHECK)
  cases = {
    "response_tokens": (
      dataclasses.replace(good, response_tokens=good.response_tokens + VOCAB),
      "token_range",
    ),
    "prompt_lengths": (
      dataclasses.replace(good, prompt_lengths=np.array([2, 3], np.int32)),
      "shape",
    ),
    "rewards": (dataclasses.replace(good, rewards=np.array([0, np.inf], np.float32)), "non_finite"),
    "image_index": (dataclasses.replace(good, image_index=np.array([0, 0], np.int32)), "shape"),
    "logprobs": (
      dataclasses.replace(good, logprobs=np.array([[-1, 0.5], [-1, 0]], np.float32)),
      "value_range",
    ),
  }
  for field, (bad, reason) in cases.items():
    with pytest.raises(PayloadError) as err:
      validate_payload(9, bad, 0, **CHECK)
    assert (err.value.field, err.value.reason) == (field, reason)
    assert str(err.value).startswith(f"group 9: field '{field}' ") and "accepted: " in str(
      err.value
    )
  with pytest.raises(
    PayloadError, match="field 'prompt_lengths' is 0 at sample 1; accepted: 1 <= length <= 2"
  ):
    validate_payload(
      9, dataclasses.replace(good, prompt_lengths=np.array([2, 0], np.int32)), 0, **CHECK
    )


def test_arrays_round_trip_keeps_only_present_fields():
  full = validate_payload(
    0, _input([[1], [2, 3]], [[0, 1, 1], [1, 0, 0]], ref=True, image_index=[0, 0]), 1, **CHECK
  )
  bare = validate_payload(1, _input([[4]], [[1, 1, 0]]), 0, **CHECK)
  assert set(full.to_arrays()) == set(FIELD_DTYPES)
  assert set(bare.to_arrays()) == set(FIELD_DTYPES) - {"ref_logprobs", "image_index"}
  for p in (full, bare):
    back = GroupPayload.from_arrays(p.to_arrays())
    for name in FIELD_DTYPES:
      x, y = getattr(p, name), getattr(back, name)
      assert (x is None) == (y is None), name
      if x is not None:
        np.testing.assert_array_equal(y, x, err_msg=name)
    unpickled = pickle.loads(pickle.dumps(p))  # how Ray moves it
    np.testing.assert_array_equal(unpickled.response_mask, p.response_mask)
  with pytest.raises(ValueError, match=r"unknown payload fields \['advantages'\]"):
    GroupPayload.from_arrays({**bare.to_arrays(), "advantages": np.zeros(1, np.float32)})
  with pytest.raises(ValueError, match=r"payload fields \['rewards'\] are missing"):
    GroupPayload.from_arrays({k: v for k, v in bare.to_arrays().items() if k != "rewards"})


def test_stack_rows_pads_groups_of_different_widths():
  a = validate_payload(
    0, _input([[5, 6, 7], [8]], [[1, 0, 1, 0], [1, 1, 0, 0]], ref=True), 0, **CHECK
  )
  b = validate_payload(
    1, _input([[9, 10]], [[1, 1, 1, 1, 1, 1]], ref=True, image_index=[0]), 1, **CHECK
  )
  rows = stack_rows([a, b])
  assert "image_index" not in rows  # only group b has it
  assert set(rows) == set(FIELD_DTYPES) - {"image_index"}
  np.testing.assert_array_equal(rows["prompt_tokens"], [[5, 6, 7], [8, 0, 0], [9, 10, 0]])
  np.testing.assert_array_equal(rows["prompt_lengths"], [3, 1, 2])
  np.testing.assert_array_equal(
    rows["response_mask"], [[1, 0, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1] * 6]
  )
  np.testing.assert_array_equal(rows["response_lengths"], [3, 2, 6])
  np.testing.assert_array_equal(
    rows["response_tokens"],
    np.concatenate([np.pad(a.response_tokens, ((0, 0), (0, 2))), b.response_tokens]),
  )
  np.testing.assert_array_equal(
    rows["logprobs"], [[-1, 0, -3, 0, 0, 0], [-1, -2, 0, 0, 0, 0], [-1, -2, -3, -4, -5, -6]]
  )
  np.testing.assert_array_equal(rows["ref_logprobs"][0], [-0.5, 0, -0.5, 0, 0, 0])
  np.testing.assert_array_equal(rows["rewards"], [0, 1, 0])
  for name, x in rows.items():
    assert x.dtype == FIELD_DTYPES[name], name
  both = stack_rows([b, b])
  np.testing.assert_array_equal(both["image_index"], [0, 0])
  with pytest.raises(ValueError, match="no group payloads"):
    stack_rows([])
