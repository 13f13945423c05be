"""Decoder tests: reference numerics, padding, KV-cache decode, dtypes, variants, sharding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from knitjax import sharding
from knitjax.models import attention
from knitjax.models.attention import SequenceMask
from knitjax.models.transformer import Transformer, TransformerConfig

TINY = TransformerConfig(
  vocab_size=256,
  num_layers=2,
  d_model=128,
  num_heads=4,
  num_kv_heads=2,
  head_dim=32,
  ffn_dim=256,
  qk_norm=True,
)
# Every option flipped away from TINY's, to cover the other code paths.
QWEN2_UNTIED = dataclasses.replace(TINY, qk_norm=False, qkv_bias=True, tie_embeddings=False)
VARIANTS = {"qwen3_tied": TINY, "qwen2_untied": QWEN2_UNTIED}


def _model(config: TransformerConfig, seed: int = 0) -> Transformer:
  model = Transformer(config, rngs=nnx.Rngs(seed))
  if config.qkv_bias:  # zero-initialised; make them matter for the comparisons
    key = jax.random.key(seed + 1)
    for path, bias in nnx.iter_graph(model):
      if isinstance(bias, nnx.Param) and path[-1] in ("q_bias", "k_bias", "v_bias"):
        key, sub = jax.random.split(key)
        bias[...] = 0.1 * jax.random.normal(sub, bias.shape)
  return model


@nnx.jit
def _forward(model, tokens, positions, valid, embeddings=None):
  return model(tokens, positions, valid, embeddings_btd=embeddings)


def _left_padded(rng, lens, prompt_len, response_len, vocab):
  """[left-padded prompt | response] tokens, valid mask and positions (trainer layout)."""
  b = len(lens)
  valid = np.arange(prompt_len)[None] >= prompt_len - np.asarray(lens)[:, None]
  valid = np.concatenate([valid, np.ones((b, response_len), bool)], axis=1)
  tokens = np.where(valid, rng.integers(1, vocab, valid.shape), 0).astype(np.int32)
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
  return tokens, valid, positions


def _reference_forward(model: Transformer, tokens_t: np.ndarray) -> np.ndarray:
  """Independent NumPy forward of one unpadded sequence, Hugging Face Qwen/Llama conventions."""
  c = model.config
  p = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))

  def rms(x, scale):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + c.norm_eps) * scale

  t = len(tokens_t)
  inv_freq = 1.0 / c.rope_theta ** (np.arange(0, c.head_dim, 2) / c.head_dim)
  emb = np.concatenate([np.outer(np.arange(t), inv_freq)] * 2, axis=-1)  # [T, H]
  cos, sin = np.cos(emb)[:, None], np.sin(emb)[:, None]

  def rope(x):  # x [T, heads, H]
    half = c.head_dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin

  x = p["embedder"]["embedding"][tokens_t]
  for i in range(c.num_layers):
    blk = p["blocks"][i]
    a = blk["attn"]
    h = rms(x, blk["attn_norm"]["scale"])
    q = np.einsum("td,dnh->tnh", h, a["q_kernel"])
    k = np.einsum("td,dnh->tnh", h, a["k_kernel"])
    v = np.einsum("td,dnh->tnh", h, a["v_kernel"])
    if c.qkv_bias:
      q, k, v = q + a["q_bias"], k + a["k_bias"], v + a["v_bias"]
    if c.qk_norm:
      q, k = rms(q, a["q_norm"]["scale"]), rms(k, a["k_norm"]["scale"])
    q, k = rope(q), rope(k)
    groups = c.num_heads // c.num_kv_heads
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)  # HF repeat_kv
    scores = np.einsum("tnh,snh->nts", q, k) / np.sqrt(c.head_dim)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("nts,snh->tnh", probs, v)
    x = x + np.einsum("tnh,nhd->td", out, a["o_kernel"])
    h = rms(x, blk["mlp_norm"]["scale"])
    m = blk["mlp"]
    gate = h @ m["gate_kernel"]
    x = x + (gate / (1 + np.exp(-gate)) * (h @ m["up_kernel"])) @ m["down_kernel"]
  x = rms(x, p["final_norm"]["scale"])
  head = p["embedder"]["embedding"].T if c.tie_embeddings else p["lm_head"]
  return x @ head


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_forward_matches_numpy_reference(name):
  model = _model(VARIANTS[name])
  tokens = np.random.default_rng(0).integers(0, 256, (1, 12)).astype(np.int32)
  positions = np.arange(12)[None]
  logits = _forward(model, tokens, positions, np.ones_like(tokens, bool))
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(logits[0], _reference_forward(model, tokens[0]), atol=1e-4, rtol=1e-4)


def test_left_padding_does_not_change_logits():
  model = _model(TINY)
  tokens, valid, positions = _left_padded(np.random.default_rng(1), [7, 3, 1], 7, 4, 256)
  logits = np.asarray(_forward(model, tokens, positions, valid))
  for b in range(3):
    alone = tokens[b][valid[b]][None]
    expected = _forward(model, alone, np.arange(alone.shape[1])[None], np.ones_like(alone, bool))
    # float32, tolerance 1e-4: only reduction order differs.
    np.testing.assert_allclose(logits[b][valid[b]], expected[0], atol=1e-4)


def test_causal_future_tokens_do_not_matter():
  model = _model(TINY)
  tokens, valid, positions = _left_padded(np.random.default_rng(2), [5, 2], 5, 3, 256)
  changed = tokens.copy()
  changed[:, -1] = (changed[:, -1] + 1) % 256
  a = _forward(model, tokens, positions, valid)
  b = _forward(model, changed, positions, valid)
  np.testing.assert_array_equal(a[:, :-1], b[:, :-1])
  assert np.abs(np.asarray(a[:, -1] - b[:, -1])).max() > 1e-3


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_kv_cache_decode_matches_forward(name):
  """Prefill a left-padded prompt, then decode token by token: float32 logits agree to 1e-4."""
  model = _model(VARIANTS[name])
  prompt_len, response_len = 6, 5
  tokens, valid, positions = _left_padded(
    np.random.default_rng(3), [6, 3, 1, 4], prompt_len, response_len, 256
  )
  full = np.asarray(_forward(model, tokens, positions, valid))
  cache = model.init_cache(4, prompt_len + response_len + 2)  # spare slots stay invalid
  logits, cache = model.prefill(
    tokens[:, :prompt_len], positions[:, :prompt_len], valid[:, :prompt_len], cache
  )
  np.testing.assert_allclose(logits, full[:, prompt_len - 1], atol=1e-4)
  decode = nnx.jit(lambda m, t, p, c: m.decode_step(t, p, c))
  for i in range(prompt_len, prompt_len + response_len - 1):
    logits, cache = decode(model, tokens[:, i], positions[:, i], cache)
    np.testing.assert_allclose(logits, full[:, i], atol=1e-4)
  assert int(cache.index) == prompt_len + response_len - 1


def test_embeddings_override_tokens():
  model = _model(TINY)
  tokens, valid, positions = _left_padded(np.random.default_rng(4), [4, 2], 4, 2, 256)
  embeddings = model.embed(tokens)
  np.testing.assert_array_equal(
    _forward(model, tokens, positions, valid, embeddings), _forward(model, tokens, positions, valid)
  )
  other = _forward(model, tokens, positions, valid, embeddings.at[:, -2].add(1.0))
  assert (
    np.abs(np.asarray(other[:, -1] - _forward(model, tokens, positions, valid)[:, -1])).max() > 1e-3
  )


def test_bfloat16_compute_stays_close_to_float32():
  model = _model(TINY)
  bf16 = nnx.merge(
    nnx.graphdef(_model(dataclasses.replace(TINY, dtype="bfloat16"))), nnx.state(model)
  )
  tokens, valid, positions = _left_padded(np.random.default_rng(5), [8, 5], 8, 8, 256)
  a, b = _forward(model, tokens, positions, valid), _forward(bf16, tokens, positions, valid)
  assert b.dtype == jnp.float32
  assert jax.tree.leaves(nnx.state(bf16))[0].dtype == jnp.float32  # params stay float32
  # Logits have std ~1; bfloat16 (8 bits of mantissa) through 2 layers: measured max error ~0.06.
  assert 0 < np.abs(np.asarray(a - b)).max() < 0.25
  assert np.abs(np.asarray(jax.nn.softmax(a) - jax.nn.softmax(b))).max() < 0.01
  cache = bf16.init_cache(2, 16)
  assert cache.k[0].dtype == jnp.bfloat16


def test_variants_have_expected_params():
  def shapes(config):
    state = nnx.to_pure_dict(nnx.state(_model(config)))
    return {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(state)}

  qwen3, qwen2 = shapes(TINY), shapes(QWEN2_UNTIED)
  attn = "['blocks'][0]['attn']"
  assert qwen3[f"{attn}['q_norm']['scale']"] == (32,)
  assert qwen3[f"{attn}['k_norm']['scale']"] == (32,)
  assert not any("bias" in k for k in qwen3) and not any("lm_head" in k for k in qwen3)
  assert qwen2[f"{attn}['q_bias']"] == (4, 32)
  assert qwen2[f"{attn}['k_bias']"] == (2, 32)
  assert qwen2["['lm_head']"] == (128, 256)
  assert not any("_norm']['scale']" in k and "attn']" in k for k in qwen2)
  d, f, v = 128, 256, 256
  per_layer = d * 4 * 32 + 2 * d * 2 * 32 + 4 * 32 * d + 3 * d * f + 2 * d
  assert sum(np.prod(s) for s in qwen3.values()) == v * d + 2 * (per_layer + 2 * 32) + d
  assert sum(np.prod(s) for s in qwen2.values()) == 2 * v * d + 2 * (per_layer + 8 * 32) + d


def test_params_carry_logical_axes():
  state = nnx.state(_model(QWEN2_UNTIED))
  axes = {
    jax.tree_util.keystr(p): v.get_metadata()["out_sharding"]
    for p, v in jax.tree_util.tree_leaves_with_path(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
  }
  assert axes["['embedder']['embedding']"] == ("vocab", "embed")
  assert axes["['blocks'][1]['attn']['k_kernel']"] == ("embed", "kv_heads", "head_dim")
  assert axes["['blocks'][1]['mlp']['down_kernel']"] == ("mlp", "embed")
  assert axes["['lm_head']"] == ("embed", "vocab")


@pytest.mark.parametrize(
  "field, value",
  [("num_kv_heads", 3), ("dtype", "float16"), ("num_layers", 0), ("head_dim", 7)],
)
def test_config_rejects_bad_values(field, value):
  with pytest.raises(ValueError, match=field):
    dataclasses.replace(TINY, **{field: value})


def test_sharded_forward_on_2x2x2_mesh_matches_one_device():
  config = dataclasses.replace(QWEN2_UNTIED, num_kv_heads=4)  # 4 kv heads split over tensor=2
  model = _model(config)
  graphdef, state = nnx.split(model)
  tokens, valid, positions = _left_padded(np.random.default_rng(6), [8, 5, 3, 1], 8, 4, 256)
  expected = _forward(model, tokens, positions, valid)

  mesh = sharding.make_mesh((2, 2, 2))
  sharded_state = jax.device_put(state, sharding.state_shardings(state, mesh))
  sharding.assert_params_sharded(sharded_state, mesh, min_size=2**12)
  batch = sharding.batch_sharding(mesh, 2)

  @jax.jit
  def forward(state, tokens, positions, valid):
    return nnx.merge(graphdef, state)(tokens, positions, valid)

  with jax.set_mesh(mesh):
    inputs = [jax.device_put(x, batch) for x in (tokens, positions, valid)]
    logits = forward(sharded_state, *inputs)
  # float32; the sharded matmuls reduce in a different order.
  np.testing.assert_allclose(logits, expected, atol=1e-4)


@pytest.mark.parametrize("impl", ["dense", "xla"])
def test_shared_prompt_row_matches_each_response_in_its_own_row(impl, monkeypatch):
  """Tree mask through the decoder: one row ``[prompt | r1 | r2 | r3 | padding]`` (positions: the
  prompt 0..P-1, each response P..P+n-1) gives each response token the hidden state it has in its
  own right-padded row ``[prompt | response]``, and the prompt the states it has in every one.
  The xla path runs with blocks of 8 queries x 6 keys, so the 20 slots span several of each."""
  monkeypatch.setattr(attention, "BLOCK_Q", 8)
  monkeypatch.setattr(attention, "BLOCK_K", 6)
  rng = np.random.default_rng(13)
  p_len, r_lens, t = 5, (4, 6, 3), 20
  prompt = rng.integers(1, TINY.vocab_size, p_len)
  responses = [rng.integers(1, TINY.vocab_size, n) for n in r_lens]
  shared = np.concatenate([prompt, *responses])
  n_real = len(shared)
  tokens = np.zeros((1, t), np.int32)
  tokens[0, :n_real] = shared
  positions = np.zeros((1, t), np.int32)
  response_positions = [p_len + np.arange(n) for n in r_lens]
  positions[0, :n_real] = np.concatenate([np.arange(p_len), *response_positions])
  seg = np.zeros((1, t), np.int32)
  seg[0, :n_real] = np.repeat(np.arange(1, len(r_lens) + 2), (p_len, *r_lens))
  prefix = np.where(seg > 1, 1, 0).astype(np.int32)
  width = p_len + max(r_lens)
  rows = np.zeros((len(r_lens), width), np.int32)
  for i, r in enumerate(responses):
    rows[i, : p_len + len(r)] = np.concatenate([prompt, r])
  row_valid = rows > 0
  row_positions = np.tile(np.arange(width, dtype=np.int32), (len(r_lens), 1))

  model = _model(dataclasses.replace(TINY, attention=impl))
  run = nnx.jit(lambda m, *a, **kw: m.hidden_states(*a, **kw))
  got = np.asarray(run(model, tokens, positions, seg > 0, mask=SequenceMask(seg, prefix)))
  want = np.asarray(run(model, rows, row_positions, row_valid))
  starts = np.cumsum((p_len, *r_lens))
  for i, n in enumerate(r_lens):
    np.testing.assert_allclose(got[0, starts[i] : starts[i] + n], want[i, p_len : p_len + n],
                               rtol=1e-5, atol=1e-5, err_msg=f"response {i}")  # fmt: skip
    np.testing.assert_allclose(got[0, :p_len], want[i, :p_len], rtol=1e-5, atol=1e-5)
  # Not vacuous: without the prefix the responses would not see the prompt.
  alone = np.asarray(run(model, tokens, positions, seg > 0, mask=SequenceMask(seg)))
  assert np.max(np.abs(alone[0, p_len:n_real] - got[0, p_len:n_real])) > 0.1
