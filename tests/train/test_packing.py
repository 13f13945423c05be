"""Packing rows into fixed-length sequences: the packer's invariants, the segment mask, and the
packed train step against the padded one (loss, metrics and updated params) for every
aggregation of the loss menu."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from knitjax import sharding
from knitjax.models import attention
from knitjax.models.attention import SequenceMask
from knitjax.models.transformer import Transformer
from knitjax.train import losses, packing
from knitjax.train.batch import make_batch, pad_rows
from knitjax.train.step import (
  StepHParams,
)
from tests import tiny
from tests.tiny import N_NEW, P_LEN, ROWS, TINY


def _minibatch(seed=0, rows=ROWS, p_len=P_LEN, n_new=N_NEW):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(3, 32, rng.integers(1, p_len + 1)).astype(np.int32) for _ in range(rows)]
  lens = rng.integers(0, n_new + 1, rows)
  responses = [rng.integers(3, 32, n).astype(np.int32) for n in lens]
  logps = [rng.normal(-3.0, 0.5, n).astype(np.float32) for n in lens]
  adv = rng.normal(size=rows).astype(np.float32)
  return make_batch(
    pad_rows(prompts, responses, logps),
    adv,
    prompt_len=p_len,
    max_new_tokens=n_new,
    pad_id=0,
    rewards=rng.normal(size=rows),
    group_ids=np.arange(rows) // 2,
  )


def test_first_fit_decreasing_hand_example():
  # Longest first: 5 -> new seq 0, 4 -> new seq 1, 3 -> new seq 2, 2 fits seq 1, 1 fits seq 0.
  assert packing.first_fit_decreasing(np.array([5, 3, 4, 2, 1]), 6) == [[0, 4], [2, 3], [1]]
  # Ties go to the lower row index; an empty row gets no segment.
  assert packing.first_fit_decreasing(np.array([2, 0, 2, 2]), 4) == [[0, 2], [3]]


def test_buckets_pack_similar_lengths_together():
  lengths = np.array([1, 8, 1, 8, 2, 7])
  # Two buckets: {0, 2, 4} (short) and {5, 1, 3} (long), each packed alone.
  assert packing.first_fit_decreasing(lengths, 9, buckets=2) == [[4, 0, 2], [1], [3], [5]]
  assert packing.first_fit_decreasing(lengths, 9) == [[1, 0], [3, 2], [5, 4]]


def test_row_longer_than_pack_len_is_an_error():
  with pytest.raises(
    ValueError, match=r"row 1 has 7 tokens, more than pack_len=6; .* \(7 tokens\)"
  ):
    packing.first_fit_decreasing(np.array([3, 7]), 6)


def test_rows_with_loss_outside_their_tokens_are_refused():
  batch = _minibatch()
  r, c = np.argwhere(~batch["valid"])[0]
  batch["loss_mask"][r, c] = 1.0  # loss on a padding column
  with pytest.raises(ValueError, match=f"row {r} carries loss outside its valid tokens"):
    packing.pack_batch(batch, pack_len=10)
  batch = _minibatch()
  r = int(np.argmax(batch["valid"].sum(1) > 2))
  batch["valid"][r, np.flatnonzero(batch["valid"][r])[1]] = False  # a hole in the row
  with pytest.raises(ValueError, match=f"row {r}: its valid tokens are not contiguous"):
    packing.pack_batch(batch, pack_len=10)


@settings(max_examples=40, deadline=None)
@given(
  st.integers(0, 2**32 - 1),
  st.integers(1, 12),
  st.integers(10, 24),
  st.integers(1, 4),
  st.integers(1, 3),
)
def test_every_row_exactly_once_tokens_and_positions_kept(seed, rows, pack_len, multiple, buckets):
  batch = _minibatch(seed, rows=rows)
  packed = packing.pack_batch(batch, pack_len=pack_len, multiple=multiple, buckets=buckets)
  seg = packed["segment_ids"]
  assert seg.dtype == np.int32 and seg.shape[1] == pack_len and len(seg) % multiple == 0
  assert len(seg) >= multiple
  assert all(v.shape == seg.shape for v in packed.values())
  np.testing.assert_array_equal(packed["valid"], seg > 0)
  seen = []
  for s in range(len(seg)):
    ids = seg[s]
    n = int((ids > 0).sum())
    assert (ids[:n] > 0).all() and (ids[n:] == 0).all()  # real tokens first, padding after
    for j in np.unique(ids[ids > 0]):
      cols = np.flatnonzero(ids == j)
      assert (np.diff(cols) == 1).all()  # contiguous
      group = packed["group_id"][s, cols]
      # Identify the row by its group and tokens; rows are unique by the full match below.
      matches = [
        r
        for r in range(rows)
        if r not in seen
        and batch["group_id"][r] == group[0]
        and np.array_equal(batch["tokens"][r][batch["valid"][r]], packed["tokens"][s, cols])
        and np.array_equal(batch["loss_mask"][r][batch["valid"][r]], packed["loss_mask"][s, cols])
        and np.array_equal(
          batch["behavior_logp"][r][batch["valid"][r]], packed["behavior_logp"][s, cols]
        )
        and np.array_equal(batch["targets"][r][batch["valid"][r]], packed["targets"][s, cols])
      ]
      assert matches, (s, j)
      r = matches[0]
      seen.append(r)
      np.testing.assert_array_equal(packed["positions"][s, cols], np.arange(len(cols)))
      np.testing.assert_array_equal(
        packed["positions"][s, cols], batch["positions"][r][batch["valid"][r]]
      )
      assert (packed["advantages"][s, cols] == batch["advantages"][r]).all()
      assert (packed["rewards"][s, cols] == batch["rewards"][r]).all()
  assert sorted(seen) == [r for r in range(rows) if batch["valid"][r].any()]
  assert (packed["loss_mask"][seg == 0] == 0).all() and (packed["group_id"][seg == 0] == -1).all()


def test_segment_mask_matches_brute_force():
  rng = np.random.default_rng(3)
  b, t = 3, 9
  seg = np.sort(rng.integers(0, 4, (b, t)), axis=1)[:, ::-1].copy()  # padding (0) last
  seg = np.where(seg > 0, 4 - seg, 0).astype(np.int32)
  valid = seg > 0
  seg_j = jnp.asarray(seg)
  got = np.asarray(attention.dense_mask(t, jnp.asarray(valid), 0, seg_j, seg_j))
  for i in range(b):
    for q in range(t):
      for k in range(t):
        want = k <= q and ((valid[i, k] and seg[i, q] == seg[i, k]) or k == q)
        assert got[i, q, k] == want, (i, q, k)


def _source_index(batch, **kw):
  """Packs ``batch`` with its tokens replaced by their flat ``[R * T]`` index: the packed
  ``tokens`` then say where each packed slot comes from (valid slots only)."""
  marked = dict(
    batch,
    tokens=np.arange(batch["tokens"].size, dtype=np.int32).reshape(-1, batch["tokens"].shape[1]),
  )
  packed = packing.pack_batch(batch, **kw)
  return packed, packing.pack_batch(marked, **kw)["tokens"]


def test_packed_forward_gives_the_padded_rows_logits():
  batch = _minibatch(1)
  packed, src = _source_index(batch, pack_len=P_LEN + N_NEW + 3)
  graphdef, params = nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)))

  @jax.jit
  def logits(tokens, positions, valid, segment_ids):
    return nnx.merge(graphdef, params)(tokens, positions, valid, mask=SequenceMask(segment_ids))

  padded = np.asarray(logits(batch["tokens"], batch["positions"], batch["valid"], None))
  got = np.asarray(logits(*(packed[k] for k in ("tokens", "positions", "valid", "segment_ids"))))
  v = packed["valid"]
  want = padded.reshape(-1, TINY.vocab_size)[src[v]]
  np.testing.assert_allclose(got[v], want, rtol=1e-5, atol=1e-5)


# One mode per aggregation, so the menu's per-row terms (GSPO ratios, CISPO, dual-clip, TIS, each
# KL estimator, entropy) all run packed at least once.
MODES = {
  "token_mean": dict(aggregation="token_mean", tis_cap=2.0, kl_estimator="k3"),
  "seq_mean_token_mean": dict(
    aggregation="seq_mean_token_mean", ratio_level="sequence", eps_c=1.5, kl_estimator="k1",
    kl_clamp=0.5,
  ),
  "seq_mean_token_sum_unscaled": dict(
    aggregation="seq_mean_token_sum_unscaled", objective="cispo", ratio_level="sequence_token",
    kl_estimator="k2",
  ),
  "dr_grpo": dict(aggregation="dr_grpo", ratio_level="sequence", eps_high=0.28),
  "seq_mean_token_sum": dict(aggregation="seq_mean_token_sum", objective="cispo"),
}  # fmt: skip


@pytest.mark.parametrize("mode", sorted(MODES))
def test_packed_policy_loss_equals_padded(mode):
  """The loss alone, for each mode: value, metric sums and the gradient in the log-probs."""
  batch = _minibatch(seed=5, rows=12)
  packed, src = _source_index(batch, pack_len=P_LEN + N_NEW + 5, multiple=2)
  rng = np.random.default_rng(0)
  logp, ref, ent = (
    (batch["behavior_logp"] + rng.normal(0, 0.3, batch["valid"].shape)).astype(np.float32)
    for _ in range(3)
  )
  config = losses.LossConfig(entropy_coef=0.01, kl_coef=0.05, **MODES[mode])
  norm = losses.Normalizer.from_mask(batch["loss_mask"], max_len=N_NEW)
  p_norm = losses.Normalizer.from_mask(
    packed["loss_mask"], max_len=N_NEW, segment_ids_bt=packed["segment_ids"]
  )
  assert (p_norm.num_seqs, p_norm.num_tokens) == (norm.num_seqs, norm.num_tokens)

  def loss(lp, b, extra):
    return losses.policy_loss(
      lp, b["behavior_logp"], b["advantages"], b["loss_mask"], config=config, norm=extra["norm"],
      ref_logp_bt=extra["ref"], entropy_bt=extra["ent"], segment_ids_bt=b.get("segment_ids"),
    )  # fmt: skip

  grad = jax.value_and_grad(loss, has_aux=True)
  (l0, s0), g0 = grad(logp, batch, dict(norm=norm, ref=ref, ent=ent))
  take = lambda x: np.where(packed["valid"], x.reshape(-1)[src], 0.0).astype(np.float32)  # noqa: E731
  (l1, s1), g1 = grad(take(logp), packed, dict(norm=p_norm, ref=take(ref), ent=take(ent)))
  np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-7)
  for k in s0:
    np.testing.assert_allclose(s1[k], s0[k], rtol=1e-5, atol=1e-6, err_msg=k)
  np.testing.assert_allclose(
    np.asarray(g1)[packed["valid"]], take(np.asarray(g0))[packed["valid"]], rtol=1e-5, atol=1e-7
  )
  # Gradient only on loss tokens, and every loss token of the padded rows is in the packed ones.
  assert float(np.abs(np.asarray(g1)).sum()) == pytest.approx(
    float(np.abs(np.asarray(g0)).sum()), rel=1e-5
  )


def sgd_step(mesh, batch, hparams, *, packed, micro_batches=2, config=TINY, adjust=None):
  """One real train step (SGD, lr 1, a reference of 0.9 x the params) on ``batch``: the
  parameter change and the host metrics. ``adjust(params)`` edits the fresh params in place."""
  before, after, metrics = tiny.train_step(
    mesh, batch, hparams, micro_batches=micro_batches, config=config, ref_scale=0.9,
    packed=packed, edit_params=adjust,
  )  # fmt: skip
  return tiny.gradient(before, after), metrics


def _run(mesh, batch, loss_config, *, packed):
  return sgd_step(mesh, batch, StepHParams(loss=loss_config, max_new_tokens=N_NEW), packed=packed)


# The step test compiles two steps per mode (~10 s or more on two busy cores): two modes whose
# per-row terms differ most (token-level ratios and TIS; CISPO with sequence-token ratios) carry
# the packed step's wiring, while every mode's loss runs packed above.
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum_unscaled"])
def test_packed_step_equals_padded_step(mode):
  """Loss, metrics and the SGD update agree to float32 summation-order tolerance (rtol 1e-5 on
  the loss and metrics, 1e-4 / atol 1e-6 on each gradient entry)."""
  mesh = sharding.make_mesh((2, 1, 1), devices=jax.devices()[:2])  # rows on 2 batch shards
  batch = _minibatch(seed=7, rows=8)
  packed = packing.pack_batch(batch, pack_len=P_LEN + N_NEW + 4, multiple=4)
  assert packed["valid"].size < batch["valid"].size  # fewer token slots than padded
  loss_config = losses.LossConfig(entropy_coef=0.01, kl_coef=0.05, **MODES[mode])
  g0, m0 = _run(mesh, batch, loss_config, packed=False)
  g1, m1 = _run(mesh, packed, loss_config, packed=True)
  assert m0["grad_norm"] > 0 and m0["kl"] != 0
  assert m1["num_seqs"] == m0["num_seqs"] and m1["num_tokens"] == m0["num_tokens"]
  for key in sorted(m0):
    np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5, atol=1e-6, err_msg=key)
  tiny.assert_trees_close(g1, g0, rtol=1e-4, atol=1e-6)


def test_packed_lora_step_equals_padded_step():
  """With LoRA (adapters trained, the base frozen and the reference) the packed update too."""
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  graphdef, adapters, base = tiny.lora_model(mesh)  # B != 0: the adapters matter
  batch = _minibatch(seed=7)
  hp = StepHParams(loss=losses.LossConfig(kl_coef=0.05, **MODES["seq_mean_token_mean"]))
  out = []
  for b, packed in ((batch, False), (packing.pack_batch(batch, pack_len=14, multiple=2), True)):
    out.append(tiny.lora_step(mesh, graphdef, adapters, base, b, hp, packed=packed))
  (p0, m0), (p1, m1) = out
  assert m0["kl"] != 0
  for key in sorted(m0):
    np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5, atol=1e-6, err_msg=key)
  for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
