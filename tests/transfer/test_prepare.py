"""Batch preparation with packing: a consumer's packed mini-batch, its packing metrics, and
several consumers agreeing on one packed sequence count."""

import dataclasses

import jax
import numpy as np
import pytest

from knitjax import sharding
from knitjax.train import layouts
from knitjax.train.packing import PackSpec, packing_metrics
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.payload import synthetic_payload
from knitjax.transfer.prepare import MiniBatchPreparer
from knitjax.transfer.storage import InProcessStorageUnit
from tests.transfer.test_access import LIMITS, N_NEW, P_LEN, ROW_SPEC, VOCAB, G, _payloads, _stored

PACK_LEN = 14


def test_packed_mini_batch_reports_its_packing_metrics():
  payloads = _payloads(2, n=4)
  minibatch, units = _stored(payloads)
  mesh = sharding.make_mesh((2, 1, 1), devices=jax.devices()[:2])
  prepare = MiniBatchPreparer(
    units, row_spec=ROW_SPEC, mesh=mesh, micro_batches=2, consumer=0, num_consumers=1,
    layout=layouts.Packed(PackSpec(pack_len=PACK_LEN, multiple=4)),
  )  # fmt: skip
  batch, info = prepare(minibatch)
  seg = np.asarray(batch["segment_ids"]).reshape(-1, PACK_LEN)
  rows = G * len(payloads)
  real = sum(P_LEN + int(n) for p in payloads for n in p["response_lengths"])  # full prompts
  assert int(np.asarray(batch["valid"]).sum()) == real
  per_sequence = seg.max(axis=1)
  assert per_sequence.sum() == rows and len(seg) % 4 == 0
  assert info["pack_rows"] == len(seg)
  assert info["pack_fill"] == pytest.approx(real / (len(seg) * PACK_LEN))
  assert info["pack_padded_fill"] == pytest.approx(real / (rows * (P_LEN + N_NEW)))
  assert info["pack_segments_mean"] == pytest.approx(rows / len(seg))
  assert info["pack_segments_max"] == per_sequence.max() >= 2
  assert info["response_tokens"] == float(np.asarray(batch["loss_mask"]).sum())  # kept as before


def _two_units(seed=0):
  """Four groups, metadata with their real lengths: unit 0's two with full-length responses
  (rows of P + N tokens, one per packed sequence), unit 1's with one-token responses (two rows
  per sequence), so the two consumers' own rows need different sequence counts."""
  rng = np.random.default_rng(seed)
  units = {u: InProcessStorageUnit(LIMITS, unit_id=u) for u in (0, 1)}
  metas = []
  for gid in range(4):
    unit = gid % 2
    n = N_NEW if unit == 0 else 1
    p = synthetic_payload(
      rng, group_size=G, prompt_len=P_LEN, response_len=N_NEW, vocab_size=VOCAB, min_response=n
    )
    p = {**p, "response_lengths": np.minimum(p["response_lengths"], n)}
    p["response_mask"] = np.arange(N_NEW)[None] < p["response_lengths"][:, None]
    p["logprobs"] = np.where(p["response_mask"], p["logprobs"], 0).astype(np.float32)
    p["rewards"] = rng.normal(size=G).astype(np.float32)
    units[unit].put(gid, p)
    metas.append(
      GroupMeta(
        group_id=gid, cls="a", gen_version=0, num_samples=G, prompt_tokens=(P_LEN,) * G,
        response_tokens=tuple(int(x) for x in p["response_lengths"]), storage_unit=unit,
        reward_mean=float(p["rewards"].mean()), reward_std=float(p["rewards"].std()),
      )
    )  # fmt: skip
  return MiniBatch(0, 0, tuple(metas)), units


def _consumer_parts(minibatch, units, mesh, row_spec, spec):
  """Each of two consumers' prepared (device) batch and info, as one process sees them."""
  return [
    MiniBatchPreparer(
      units, row_spec=row_spec, mesh=mesh, micro_batches=2, consumer=c, num_consumers=2,
      locality_slack=1e9, layout=layouts.Packed(spec),
    )(minibatch)
    for c in range(2)
  ]  # fmt: skip


def test_consumers_pack_into_the_same_number_of_sequences():
  minibatch, units = _two_units()
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  spec = PackSpec(pack_len=PACK_LEN, multiple=4)  # 2 micro-batches x 2 (consumers' shards)
  parts = _consumer_parts(minibatch, units, mesh, ROW_SPEC, spec)
  # On their own: consumer 0's 6 rows of 10 tokens need 6 sequences, consumer 1's 6 rows of 5
  # need 3 (rounded to 4); both lay out 6.
  local = PackSpec(pack_len=PACK_LEN, multiple=2)
  row_len = P_LEN + N_NEW
  assert local.plan_parts([[P_LEN + N_NEW] * 6], row_len=row_len)[0] == 6
  assert local.plan_parts([[P_LEN + 1] * 6], row_len=row_len)[0] == 4
  for batch, _ in parts:
    seg = np.asarray(batch["segment_ids"])
    assert seg.shape == (2, 3, PACK_LEN) and int(seg.max(axis=-1).sum()) == 2 * G
  # Both report the whole mini-batch's metrics: those of the assembled arrays.
  host = [jax.device_get(b) for b, _ in parts]
  packed = {k: np.concatenate([h[k] for h in host], axis=1).reshape(-1, PACK_LEN) for k in host[0]}
  padded, _ = MiniBatchPreparer(units, row_spec=ROW_SPEC, mesh=mesh, micro_batches=2)(minibatch)
  want = packing_metrics({"valid": np.asarray(padded["valid"]).reshape(4 * G, -1)}, packed)
  assert want["pack_rows"] == 12 and want["pack_segments_max"] == 2
  assert want["pack_segments_mean"] == pytest.approx(4 * G / 12)
  for _, info in parts:
    assert {k: info[k] for k in want} == pytest.approx(want)


def test_metadata_that_disagrees_with_the_payloads_is_an_error():
  minibatch, units = _two_units()
  # Unit 0's groups claim one-token responses: the plan says 4 sequences, its rows need 6.
  groups = [
    dataclasses.replace(g, response_tokens=(1,) * G) if g.storage_unit == 0 else g
    for g in minibatch.groups
  ]
  minibatch = dataclasses.replace(minibatch, groups=tuple(groups))
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  prepare = MiniBatchPreparer(
    units, row_spec=ROW_SPEC, mesh=mesh, micro_batches=2, consumer=0, num_consumers=2,
    locality_slack=1e9, layout=layouts.Packed(PackSpec(pack_len=PACK_LEN, multiple=4)),
  )  # fmt: skip
  with pytest.raises(ValueError, match="consumer 0: the rows need 6 packed sequences .* metadata"):
    prepare(minibatch)


def test_two_packing_consumers_give_the_padded_update():
  """Two consumers' packed parts, assembled as to_global would, give the update of the whole
  mini-batch padded on one consumer: GRPO with the KL as a reward, computed in the step over
  both consumers' segments (float32: metrics rtol 1e-5, update rtol 1e-4 / atol 1e-6)."""
  from knitjax.train import losses
  from knitjax.train.step import StepHParams
  from tests import tiny

  minibatch, units = _two_units(1)
  mesh = sharding.make_mesh((2, 1, 1), devices=jax.devices()[:2])
  spec = PackSpec(pack_len=PACK_LEN, multiple=4)
  # Each consumer's local part (one process holds one of the 2 batch shards in a real run).
  one = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  host = [jax.device_get(b) for b, _ in _consumer_parts(minibatch, units, one, ROW_SPEC, spec)]
  packed = {k: np.concatenate([h[k] for h in host], axis=1) for k in host[0]}
  padded, _ = MiniBatchPreparer(units, row_spec=ROW_SPEC, mesh=mesh, micro_batches=2)(minibatch)
  cfg = dataclasses.replace(tiny.TINY, vocab_size=VOCAB)  # the stored groups' vocab
  hp = StepHParams(loss=losses.LossConfig(kl_coef=0.05, kl_penalty="reward"), max_new_tokens=N_NEW)
  out = []
  for batch, is_packed in ((padded, False), (packed, True)):
    before, after, metrics = tiny.train_step(
      mesh, batch, hp, config=cfg, ref_scale=0.9, packed=is_packed
    )
    out.append((tiny.gradient(before, after), metrics))
  (g0, m0), (g1, m1) = out
  assert m0["kl_reward_penalty"] > 0 and m1["num_seqs"] == m0["num_seqs"] == 4 * G
  for key in sorted(m0):
    np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5, atol=1e-6, err_msg=key)
  tiny.assert_trees_close(g1, g0, rtol=1e-4, atol=1e-6)
