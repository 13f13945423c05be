"""On-demand access: storage payloads -> trainer batch, honouring response_mask end to end."""

import numpy as np
import pytest

from knitjax.train.advantages import compute_advantages
from knitjax.train.batch import make_batch, pad_rows
from knitjax.transfer.access import RowSpec, fetch_minibatch
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.payload import synthetic_payload
from knitjax.transfer.storage import InProcessStorageUnit, StorageLimits

P_LEN, N_NEW, G, VOCAB = 4, 6, 3, 40
ROW_SPEC = RowSpec(estimator="grpo", prompt_len=P_LEN, max_new_tokens=N_NEW, pad_id=0)
LIMITS = StorageLimits(vocab_size=VOCAB, max_seq_len=P_LEN + N_NEW, max_bytes=1 << 20)


def _meta(gid, unit):
  return GroupMeta(
    group_id=gid,
    cls="a",
    gen_version=0,
    num_samples=G,
    prompt_tokens=(1,) * G,
    response_tokens=(1,) * G,
    storage_unit=unit,
  )


def _stored(payloads):
  units = {u: InProcessStorageUnit(LIMITS, unit_id=u) for u in (0, 1)}
  metas = []
  for gid, p in enumerate(payloads):
    units[gid % 2].put(gid, p)
    metas.append(_meta(gid, gid % 2))
  return MiniBatch(0, 0, tuple(metas)), units


def _per_row(payloads):
  """What the consumer used to build: each row cut at its lengths, every response token trained."""
  prompts, responses, logps, advs = [], [], [], []
  for p in payloads:
    advs.append(np.asarray(compute_advantages(p["rewards"][None], "grpo"))[0])
    for k in range(G):
      n = int(p["response_lengths"][k])
      prompts.append(p["prompt_tokens"][k])
      responses.append(p["response_tokens"][k][:n])
      logps.append(p["logprobs"][k][:n])
  return make_batch(
    pad_rows(prompts, responses, logps),
    np.concatenate(advs),
    prompt_len=P_LEN,
    max_new_tokens=N_NEW,
    pad_id=0,
    rewards=np.concatenate([p["rewards"] for p in payloads]),
    group_ids=np.repeat(np.arange(len(payloads)), G),  # _stored's group ids: 0, 1, ...
  )


def _payloads(seed, n=4, prompt_len=P_LEN, response_len=N_NEW):
  rng = np.random.default_rng(seed)
  return [
    synthetic_payload(
      rng, group_size=G, prompt_len=prompt_len, response_len=response_len, vocab_size=VOCAB
    )
    for _ in range(n)
  ]


def test_without_holes_the_batch_is_the_per_row_one():
  payloads = _payloads(0)
  payloads[1] = _payloads(1, n=1, prompt_len=2, response_len=3)[0]  # narrower group
  mb, units = _stored(payloads)
  batch, info = fetch_minibatch(mb, units, ROW_SPEC)
  want = _per_row(payloads)
  assert batch.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(batch[k], want[k], err_msg=k)
  assert info["response_tokens"] == sum(p["response_lengths"].sum() for p in payloads)


def test_hole_in_a_stored_mask_is_not_trained_on():
  """Regression: storage kept a holed response_mask but the trainer used only the lengths."""
  payloads = _payloads(2, n=2)
  p = payloads[0]
  p["response_lengths"] = np.full(G, N_NEW, np.int32)
  p["response_mask"] = np.ones((G, N_NEW), bool)
  p["response_mask"][0, 2:4] = False  # tool output inside sample 0's response
  p["logprobs"] = np.full((G, N_NEW), -1.5, np.float32)
  mb, units = _stored(payloads)
  batch, info = fetch_minibatch(mb, units, ROW_SPEC)
  # Position P - 1 + k predicts response token k.
  hole = [P_LEN - 1 + 2, P_LEN - 1 + 3]
  assert (batch["loss_mask"][0, hole] == 0).all() and (batch["behavior_logp"][0, hole] == 0).all()
  assert batch["valid"][0, P_LEN + 2 : P_LEN + 4].all()  # still attended to
  np.testing.assert_array_equal(batch["tokens"][0, P_LEN:], p["response_tokens"][0])
  loss = batch["loss_mask"][0, P_LEN - 1 : P_LEN - 1 + N_NEW]
  np.testing.assert_array_equal(loss, [1, 1, 0, 0, 1, 1])
  np.testing.assert_array_equal(batch["loss_mask"][1:G, P_LEN - 1 : -1], 1)
  # Apart from the hole, the batch is the per-row one.
  want = _per_row(payloads)
  for k in want:
    got = batch[k].copy()
    if k in ("loss_mask", "behavior_logp"):
      got[0, hole] = want[k][0, hole]
    np.testing.assert_array_equal(got, want[k], err_msg=k)
  total = sum(q["response_mask"].sum() for q in payloads)
  assert info["response_tokens"] == total == batch["loss_mask"].sum()


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"estimator": "ppo"}, "estimator is 'ppo'"),
    ({"prompt_len": 0}, "prompt_len is 0"),
    ({"max_new_tokens": 2.0}, "max_new_tokens is 2.0"),
    ({"pad_id": -1}, "pad_id is -1"),
  ],
)
def test_layout_validates_itself(kwargs, match):
  base = dict(estimator="grpo", prompt_len=4, max_new_tokens=4, pad_id=0)
  with pytest.raises(ValueError, match=match):
    RowSpec(**{**base, **kwargs})


def test_response_longer_than_the_layout_is_refused():
  mb, units = _stored(_payloads(3, n=2))
  short = RowSpec(estimator="grpo", prompt_len=P_LEN, max_new_tokens=1, pad_id=0)
  with pytest.raises(ValueError, match="does not fit max_new_tokens=1"):
    fetch_minibatch(mb, units, short)


def test_gae_layout_leaves_the_advantages_to_the_step():
  """With the critic the host computes no advantages; rows carry rewards and group ids."""
  payloads = _payloads(5, n=3)
  mb, units = _stored(payloads)
  row_spec = RowSpec(estimator="gae", prompt_len=P_LEN, max_new_tokens=N_NEW, pad_id=0)
  batch, _ = fetch_minibatch(mb, units, row_spec)
  np.testing.assert_array_equal(batch["advantages"], 0.0)
  np.testing.assert_array_equal(batch["rewards"], np.concatenate([p["rewards"] for p in payloads]))
  np.testing.assert_array_equal(batch["group_id"], np.repeat([0, 1, 2], G))
