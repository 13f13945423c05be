"""Attention implementations: blockwise "xla" against the dense reference (values, gradients, the
KV cache, segments), through a whole Transformer, and its compiled memory growth.

Tolerances (float32): outputs and input gradients within 2e-5 absolute of the dense reference
(measured ~1e-6: the online softmax only reorders sums); Transformer logits and param gradients
within 1e-4 relative-or-absolute.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from knitjax.models import attention
from knitjax.models.attention import SequenceMask
from knitjax.models.transformer import Transformer, TransformerConfig
from lab.bench.compiled_memory import compiled_memory

ATOL = 2e-5


def _qkv(rng, b, t, s, n, k, h):
  q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
  kk = jnp.asarray(rng.normal(size=(b, s, k, h)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, s, k, h)), jnp.float32)
  return q, kk, v


def _left_valid(b, t, pads):
  return jnp.asarray(np.arange(t)[None] >= np.asarray(pads)[:, None])


def _packed_segments(valid, cut):
  """Two packed sequences per row: segment 1 before ``cut``, 2 from it, 0 on padding."""
  t = valid.shape[1]
  return jnp.where(valid, 1 + (jnp.arange(t) >= cut)[None], 0).astype(jnp.int32)


@pytest.mark.parametrize(
  "n,k,t,block_q,block_k,segments",
  [
    (4, 2, 13, 4, 5, False),  # GQA, odd length, blocks that do not divide it
    (4, 2, 13, 4, 5, True),  # ... with packed segments
    (2, 2, 9, 8, 3, False),  # MHA, one query block over several key blocks
    (6, 1, 17, 5, 17, True),  # MQA, one key block
  ],
)
def test_xla_matches_dense_values_and_gradients(n, k, t, block_q, block_k, segments):
  rng = np.random.default_rng(0)
  q, kk, v = _qkv(rng, 2, t, t, n, k, 8)
  valid = _left_valid(2, t, [3, 0])
  seg = _packed_segments(valid, t // 2 + 1) if segments else None
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

  def loss(impl, q, kk, v):
    out = attention.attend(
      q, kk, v, kv_valid_bs=valid, q_segment_bt=seg, kv_segment_bs=seg, impl=impl,
      block_q=block_q, block_k=block_k,
    )  # fmt: skip
    return jnp.sum(out * w), out

  grad = lambda impl: jax.jit(jax.grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2), has_aux=True))  # noqa: E731
  (dq, dk, dv), out = grad("xla")(q, kk, v)
  (rq, rk, rv), ref = grad("dense")(q, kk, v)
  np.testing.assert_allclose(out, ref, atol=ATOL)
  for got, want in ((dq, rq), (dk, rk), (dv, rv)):
    np.testing.assert_allclose(got, want, atol=ATOL)
  assert float(jnp.max(jnp.abs(rk))) > 0.1  # the gradients are not trivially zero


def test_segments_cut_attention_between_packed_sequences():
  rng = np.random.default_rng(1)
  q, kk, v = _qkv(rng, 1, 10, 10, 2, 1, 8)
  valid = jnp.ones((1, 10), bool)
  seg = _packed_segments(valid, 4)
  out = jax.jit(
    lambda q, kk, v: attention.attend(
      q, kk, v, kv_valid_bs=valid, q_segment_bt=seg, kv_segment_bs=seg, impl="xla",
      block_q=3, block_k=3,
    )
  )(q, kk, v)  # fmt: skip
  # The second sequence alone, unpacked, gives the same outputs as inside the pack.
  alone = attention.attend(q[:, 4:], kk[:, 4:], v[:, 4:], kv_valid_bs=valid[:, 4:], impl="dense")
  np.testing.assert_allclose(out[:, 4:], alone, atol=ATOL)


@pytest.mark.parametrize("offset", [0, 6, 17])
def test_cache_offset_matches_dense(offset):
  rng = np.random.default_rng(2)
  q, kk, v = _qkv(rng, 2, 3, 20, 4, 2, 8)
  valid = jnp.asarray(rng.random((2, 20)) > 0.3)
  run = jax.jit(
    lambda o, impl: attention.attend(
      q, kk, v, kv_valid_bs=valid, q_offset=o, impl=impl, block_q=2, block_k=3
    ),
    static_argnums=1,
  )
  np.testing.assert_allclose(run(offset, "xla"), run(offset, "dense"), atol=ATOL)


def test_decode_reads_only_the_filled_key_blocks():
  rng = np.random.default_rng(3)
  q, kk, v = _qkv(rng, 2, 1, 32, 4, 2, 8)
  index, block = 9, 4  # the query sits in slot 9: key blocks 0..2 (slots < 12) hold its past
  valid = jnp.asarray(np.arange(32)[None] <= index).repeat(2, 0)
  poison = jnp.arange(32)[None, :, None, None] >= 12
  k_bad, v_bad = jnp.where(poison, jnp.nan, kk), jnp.where(poison, jnp.nan, v)
  kw = dict(kv_valid_bs=valid, q_offset=jnp.int32(index), block_k=block)
  got = jax.jit(lambda kk, v: attention.attend(q, kk, v, impl="xla", **kw))(k_bad, v_bad)
  want = attention.attend(q, kk, v, impl="dense", **kw)
  np.testing.assert_allclose(got, want, atol=ATOL)
  # The dense path reads every slot: the unfilled ones' NaNs reach its output.
  assert np.isnan(np.asarray(attention.attend(q, k_bad, v_bad, impl="dense", **kw))).all()


def test_bfloat16_xla_stays_close_to_dense():
  rng = np.random.default_rng(4)
  q, kk, v = (x.astype(jnp.bfloat16) for x in _qkv(rng, 2, 11, 11, 4, 2, 16))
  valid = _left_valid(2, 11, [2, 0])
  kw = dict(kv_valid_bs=valid, block_q=4, block_k=4)
  got = jax.jit(lambda q, kk, v: attention.attend(q, kk, v, impl="xla", **kw))(q, kk, v)
  assert got.dtype == jnp.bfloat16
  want = attention.attend(q, kk, v, impl="dense", **kw)
  np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=3e-2)


def test_implementation_choice_and_errors():
  assert attention.resolve("auto", t=16, s=16, dtype=jnp.float32, cached=False) == "dense"
  big = attention.BLOCK_K + 1
  assert attention.resolve("auto", t=1, s=big, dtype=jnp.float32, cached=True) == "xla"
  assert attention.resolve("dense", t=big, s=big, dtype=jnp.float32, cached=False) == "dense"
  with pytest.raises(ValueError, match="'cudnn' needs a GPU"):
    attention.resolve("cudnn", t=8, s=8, dtype=jnp.bfloat16, cached=False)
  with pytest.raises(ValueError, match="'splash' needs a TPU"):
    attention.resolve("splash", t=8, s=8, dtype=jnp.float32, cached=False)
  with pytest.raises(ValueError, match=r"TransformerConfig.attention must be one of \['auto'"):
    TransformerConfig(**{**_TINY_FIELDS, "attention": "flash"})


def _temp_bytes(impl, t, *, n=2, k=1, h=16, block=128):
  shape = jax.ShapeDtypeStruct((1, t, n, h), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, t, k, h), jnp.float32)
  valid = jax.ShapeDtypeStruct((1, t), jnp.bool_)

  def loss(q, kk, v, valid):
    out = attention.attend(q, kk, v, kv_valid_bs=valid, impl=impl, block_q=block, block_k=block)
    return jnp.sum(out)

  fn = jax.grad(loss, argnums=(0, 1, 2))
  return compiled_memory(fn, shape, kv, kv, valid)["temp_bytes"]


def test_xla_temp_memory_grows_linearly_with_length():
  xla = [_temp_bytes("xla", t) for t in (1024, 4096)]
  dense = [_temp_bytes("dense", t) for t in (1024, 4096)]
  # Forward + backward hold O(T) buffers and one block of scores: 4x the length, under 4x the
  # scratch (measured 0.87 -> 1.52 MB).
  assert xla[1] / xla[0] < 4, xla
  # The dense reference holds [T, T] scores and probabilities (measured 42 -> 403 MB).
  assert dense[1] / dense[0] > 8, dense
  assert xla[1] < dense[0] / 8, (xla, dense)


# ---- through the Transformer -------------------------------------------------------------------

_TINY_FIELDS = dict(
  vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=64,
  qk_norm=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def models():
  """A dense and an xla model with the same params; the xla path with blocks of 4 queries x 3
  keys, so short test sequences span several of each."""
  dense = Transformer(TransformerConfig(**_TINY_FIELDS, attention="dense"), rngs=nnx.Rngs(0))
  xla = nnx.clone(dense)  # one random init (slow on a busy CPU), the implementation switched
  for block in xla.blocks:
    block.attn.attention = "xla"
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(attention, "BLOCK_Q", 4)
    patch.setattr(attention, "BLOCK_K", 3)
    yield dense, xla


@nnx.jit
def _forward(model, tokens, positions, valid, segments=None):
  return model(tokens, positions, valid, mask=SequenceMask(segments))


def _batch(rng, pads, t, vocab=64):
  valid = np.arange(t)[None] >= np.asarray(pads)[:, None]
  tokens = np.where(valid, rng.integers(1, vocab, valid.shape), 0).astype(np.int32)
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
  return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(valid)


def test_transformer_xla_matches_dense_logits_and_param_gradients(models):
  dense, xla = models
  tokens, positions, valid = _batch(np.random.default_rng(5), [3, 0], 11)
  seg = _packed_segments(valid, 6)
  mask = valid.astype(jnp.float32)

  @nnx.jit
  def loss_and_grad(model):
    def loss(model):
      logits = model(tokens, positions, valid, mask=SequenceMask(seg))
      return jnp.sum(jax.nn.log_softmax(logits)[..., 1] * mask), logits

    return nnx.value_and_grad(loss, has_aux=True)(model)

  (_, got), got_grad = loss_and_grad(xla)
  (_, want), want_grad = loss_and_grad(dense)
  v = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(got)[v], np.asarray(want)[v], atol=1e-4, rtol=1e-4)
  want_grad = dict(nnx.to_flat_state(want_grad))
  for path, g in nnx.to_flat_state(got_grad):
    np.testing.assert_allclose(
      g[...], want_grad[path][...], atol=1e-4, rtol=1e-4, err_msg=str(path)
    )


def test_packed_rows_match_each_sequence_alone(models):
  _, model = models
  rng = np.random.default_rng(6)
  a, b = rng.integers(1, 64, 5), rng.integers(1, 64, 6)
  tokens = np.zeros((3, 11), np.int32)
  tokens[0] = np.concatenate([a, b])  # packed: [a | b]
  tokens[1, 6:], tokens[2, 5:] = a, b  # alone, left-padded to the same width
  positions = np.stack([np.r_[np.arange(5), np.arange(6)], np.r_[[0] * 6, np.arange(5)],
                        np.r_[[0] * 5, np.arange(6)]]).astype(np.int32)  # fmt: skip
  valid = tokens > 0
  seg = np.stack([np.r_[[1] * 5, [2] * 6], valid[1], valid[2]]).astype(np.int32)
  logits = _forward(model, *map(jnp.asarray, (tokens, positions, valid, seg)))
  np.testing.assert_allclose(logits[0, :5], logits[1, 6:], atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(logits[0, 5:], logits[2, 5:], atol=1e-4, rtol=1e-4)


def test_prefill_and_decode_match_the_full_forward(models):
  dense, model = models
  prompt, steps = 7, 4
  tokens, positions, valid = _batch(np.random.default_rng(7), [2, 0], prompt + steps)
  full = _forward(model, tokens, positions, valid)
  np.testing.assert_allclose(full, _forward(dense, tokens, positions, valid), atol=1e-4, rtol=1e-4)

  @nnx.jit
  def run(model):
    cache = model.init_cache(2, 16)
    p = slice(0, prompt)
    logits, cache = model.prefill(tokens[:, p], positions[:, p], valid[:, p], cache)
    out = [logits]
    for i in range(prompt, prompt + steps - 1):
      logits, cache = model.decode_step(tokens[:, i], positions[:, i], cache)
      out.append(logits)
    return jnp.stack(out, axis=1)

  np.testing.assert_allclose(run(model), full[:, prompt - 1 : -1], atol=1e-4, rtol=1e-4)


def test_per_row_cache_index_under_vmap(models):
  """The continuous engine's cache: a row per slot, each at its own index (vmap)."""
  dense, model = models
  tokens, positions, valid = _batch(np.random.default_rng(8), [0, 0, 0], 9)
  lens = jnp.asarray([3, 6, 8])  # each row has decoded up to a different slot

  @nnx.jit
  def step(model):
    def one(tok, pos, length, row_tok, row_pos):
      cache = model.init_cache(1, 12)
      keep = (jnp.arange(9) < length)[None]
      _, cache = model.prefill(row_tok[None], row_pos[None], keep, cache)
      cache = dataclasses.replace(cache, index=length)  # slots >= length: not yet written
      return model.decode_step(tok[None], pos[None], cache)[0][0]

    take = lambda x: x[jnp.arange(3), lens]  # noqa: E731
    return jax.vmap(one)(take(tokens), take(positions), lens, tokens, positions)

  full = _forward(dense, tokens, positions, valid)
  np.testing.assert_allclose(step(model), full[jnp.arange(3), lens], atol=1e-4, rtol=1e-4)


def test_splash_wrapper_matches_dense_in_the_pallas_interpreter():
  """The TPU kernel's wrapper (GQA per kv-head, validity as segment 0, 128-padding), run by the
  Pallas interpreter on the CPU: outputs and gradients at real (non-padding) queries."""
  rng = np.random.default_rng(9)
  q, kk, v = _qkv(rng, 2, 13, 13, 4, 2, 8)
  valid = _left_valid(2, 13, [3, 0])
  seg = _packed_segments(valid, 8)
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * valid[:, :, None, None]

  def splash(q, kk, v):
    return attention._splash(q, kk, v, valid, seg, seg, 8**-0.5, interpret=True)

  def dense(q, kk, v):
    return attention.attend(q, kk, v, kv_valid_bs=valid, q_segment_bt=seg, kv_segment_bs=seg,
                            impl="dense")  # fmt: skip

  def grads(fn):
    return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=(0, 1, 2)))(q, kk, v)

  v_ = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(splash(q, kk, v))[v_], np.asarray(dense(q, kk, v))[v_],
                             atol=ATOL)  # fmt: skip
  for got, want in zip(grads(splash), grads(dense), strict=True):
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_xla_inside_shard_map_matches_dense():
  """The samplers run the model inside `jax.shard_map` over the batch: the loop carries must be
  typed as varying over the batch axes like the inputs they meet."""
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))  # fmt: skip
  rng = np.random.default_rng(10)
  q, kk, v = _qkv(rng, 2, 5, 12, 4, 2, 8)
  valid = jnp.asarray(rng.random((2, 12)) > 0.2)

  def run(impl):
    def shard(q, kk, v, valid):
      def attend(q):
        return attention.attend(q, kk, v, kv_valid_bs=valid, q_offset=jnp.int32(3), impl=impl,
                                block_q=2, block_k=3)  # fmt: skip

      return attend(q), jax.grad(lambda q: jnp.sum(attend(q) ** 2))(q)

    spec = jax.sharding.PartitionSpec("data")
    fn = jax.shard_map(shard, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, spec))
    return jax.jit(fn)(q, kk, v, valid)

  for got, want in zip(run("xla"), run("dense"), strict=True):
    np.testing.assert_allclose(got, want, atol=ATOL)


# ---- tree mask (shared-prompt attention) --------------------------------------------------------
# Each row: groups appended in order, a group (prompt length, response lengths); a group without
# responses is an ordinary packed sequence. Trailing padding up to _TREE_T.
_TREE_ROWS = (
  ((5, (4, 6, 3)), (4, (5, 2))),  # two groups, 29 tokens, 11 padding
  ((3, (7, 5, 4)), (6, (3, 3, 2)), (4, ())),  # two groups and a plain sequence, 37 tokens
)
_TREE_T = 40


def _tree_layout(rows, t):
  """Segment ids (prompt and each response its own, 0 on padding), prefix ids (a response
  token's prompt segment, 0 elsewhere), and each group's (row, prompt columns,
  [response columns])."""
  seg, prefix = np.zeros((len(rows), t), np.int32), np.zeros((len(rows), t), np.int32)
  groups = []
  for r, row in enumerate(rows):
    col, sid = 0, 0
    for p_len, r_lens in row:
      sid += 1
      prompt, prompt_sid = np.arange(col, col + p_len), sid
      seg[r, prompt] = sid
      col += p_len
      responses = []
      for n in r_lens:
        sid += 1
        cols = np.arange(col, col + n)
        seg[r, cols], prefix[r, cols] = sid, prompt_sid
        responses.append(cols)
        col += n
      groups.append((r, prompt, responses))
  return jnp.asarray(seg), jnp.asarray(prefix), groups


def _causal(q_tnh, k_tkh, v_tkh):
  """Plain causal softmax attention of one unpadded sequence (GQA), written out here."""
  t, n, h = q_tnh.shape
  kh = k_tkh.shape[1]
  q = q_tnh.reshape(t, kh, n // kh, h)
  scores = jnp.einsum("tkgh,skh->kgts", q, k_tkh) * h**-0.5
  scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
  out = jnp.einsum("kgts,skh->tkgh", jax.nn.softmax(scores, axis=-1), v_tkh)
  return out.reshape(t, n, h)


def _each_response_in_its_own_row(q, kk, v, groups):
  """The tree mask the long way: each prompt alone, each response in its own row [prompt |
  response]; outputs back at their columns (0 on padding). Every row reads its own copy of the
  prompt's keys and values, so their gradient is the sum over the rows."""
  out = jnp.zeros_like(q)
  for r, prompt, responses in groups:
    out = out.at[r, prompt].set(_causal(q[r, prompt], kk[r, prompt], v[r, prompt]))
    for cols in responses:
      row = np.concatenate([prompt, cols])
      out = out.at[r, cols].set(_causal(q[r, row], kk[r, row], v[r, row])[len(prompt) :])
  return out


def _assert_tree_mask_exact(tree_fn):
  """``tree_fn(q, k, v, valid, seg, prefix)`` against `_each_response_in_its_own_row`: outputs at
  the real tokens, and the gradients of q, k, v (float32, ~1e-6 apart in practice)."""
  rng = np.random.default_rng(11)
  seg, prefix, groups = _tree_layout(_TREE_ROWS, _TREE_T)
  valid = seg > 0
  q, kk, v = _qkv(rng, 2, _TREE_T, _TREE_T, 4, 2, 8)
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * valid[:, :, None, None]

  def grads(fn):
    loss = lambda *a: jnp.sum(fn(*a) * w)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, kk, v)

  tree = jax.jit(lambda q, kk, v: tree_fn(q, kk, v, valid, seg, prefix))
  rows = jax.jit(lambda q, kk, v: _each_response_in_its_own_row(q, kk, v, groups))
  got, want = np.asarray(tree(q, kk, v)), np.asarray(rows(q, kk, v))
  real = np.asarray(valid)
  np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=ATOL)
  (_, got_grads), (_, want_grads) = grads(tree), grads(rows)
  for name, g, r in zip("qkv", got_grads, want_grads, strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=ATOL, err_msg=f"d{name}")
  # Not vacuous: the prompts' keys get gradient from several rows, and without the prefix the
  # responses would not see their prompts at all.
  assert float(jnp.max(jnp.abs(want_grads[1]))) > 0.1
  segments_only = attention.attend(
    q, kk, v, kv_valid_bs=valid, q_segment_bt=seg, kv_segment_bs=seg, impl="dense"
  )
  response = np.asarray(prefix > 0)
  assert np.max(np.abs(np.asarray(segments_only)[response] - got[response])) > 0.1


@pytest.mark.parametrize(
  "impl,block_q,block_k",
  [
    ("dense", None, None),
    ("xla", 8, 8),  # blocks that divide T = 40; groups and responses cross block edges
    ("xla", 12, 7),  # blocks that do not: the last query and key blocks overlap the one before
  ],
)
def test_tree_mask_matches_each_response_in_its_own_row(impl, block_q, block_k):
  def tree(q, kk, v, valid, seg, prefix):
    return attention.attend(
      q, kk, v, kv_valid_bs=valid, q_segment_bt=seg, kv_segment_bs=seg, q_prefix_bt=prefix,
      impl=impl, block_q=block_q, block_k=block_k,
    )  # fmt: skip

  _assert_tree_mask_exact(tree)


def test_splash_tree_mask_matches_each_response_in_its_own_row():
  """The splash decomposition (own segment + prompt, merged by log-sum-exp, custom backward) in
  the Pallas interpreter."""

  def tree(q, kk, v, valid, seg, prefix):
    return attention._splash(q, kk, v, valid, seg, seg, 8**-0.5, q_prefix=prefix, interpret=True)

  _assert_tree_mask_exact(tree)


def test_tree_mask_needs_segment_ids():
  q, kk, v = _qkv(np.random.default_rng(12), 1, 4, 4, 2, 1, 8)
  with pytest.raises(ValueError, match="q_prefix_bt .* needs q_segment_bt"):
    attention.attend(q, kk, v, kv_valid_bs=jnp.ones((1, 4), bool),
                     q_prefix_bt=jnp.zeros((1, 4), jnp.int32), impl="dense")  # fmt: skip
