"""Sampler tests: log-probs against the trainer's forward, EOS, greedy / top-k / top-p, keys."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from knitjax import sharding
from knitjax.models.transformer import Transformer, TransformerConfig
from knitjax.rollout.sampler import Sampler, SamplingConfig

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
PROMPT_LEN, NEW = 8, 12
PAD, NO_EOS = 0, 256  # NO_EOS is outside the vocabulary: never sampled


@pytest.fixture(scope="module")
def mesh():
  # 4 batch shards, and a tensor axis of 2 that the sampler must keep consistent.
  return sharding.make_mesh((1, 4, 2))


@pytest.fixture(scope="module")
def model(mesh):
  return sharding.init_sharded(lambda: Transformer(TINY, rngs=nnx.Rngs(0)), mesh)


def _prompts(seed=0, batch=8):
  rng = np.random.default_rng(seed)
  lens = rng.integers(1, PROMPT_LEN + 1, batch).astype(np.int32)
  lens[:2] = [1, PROMPT_LEN]
  tokens = rng.integers(2, 256, (batch, PROMPT_LEN)).astype(np.int32)
  tokens = np.where(np.arange(PROMPT_LEN)[None] >= PROMPT_LEN - lens[:, None], tokens, PAD)
  return tokens, lens


@nnx.jit
def _forward(model, tokens, positions, valid):
  return model(tokens, positions, valid)


def _trainer_logits(model, prompts, prompt_lens, samples):
  """The trainer's view: logits for [left-padded prompt | right-padded response] at each response
  token's predicting position, [B, N, V]."""
  graphdef, state = model
  p, n = prompts.shape[1], samples.tokens.shape[1]
  valid = np.concatenate(
    [
      np.arange(p)[None] >= p - prompt_lens[:, None],
      np.arange(n)[None] < samples.lengths[:, None],
    ],
    axis=1,
  )
  tokens = np.concatenate([prompts, samples.tokens], axis=1)
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
  logits = _forward(nnx.merge(graphdef, jax.device_get(state)), tokens, positions, valid)
  return np.asarray(logits)[:, p - 1 : p + n - 1]


def _response_mask(samples):
  return np.arange(samples.tokens.shape[1])[None] < samples.lengths[:, None]


def _sample(model, mesh, seed=0, prompts=None, eos_id=NO_EOS, **sampling):
  graphdef, state = model
  sampler = Sampler(
    graphdef,
    mesh=mesh,
    sampling=SamplingConfig(max_new_tokens=NEW, **sampling),
    eos_id=eos_id,
    pad_id=PAD,
    prompt_len=PROMPT_LEN,
  )
  prompts, lens = _prompts() if prompts is None else prompts
  return sampler(state, prompts, lens, jax.random.key(seed)), prompts, lens


@pytest.mark.parametrize(
  "sampling",
  [dict(temperature=0.7), dict(temperature=1.3, top_k=20, top_p=0.9)],
  ids=["temperature", "top_k_top_p"],
)
def test_logprobs_equal_trainer_forward_logprobs(model, mesh, sampling):
  # eos_id 5 is a real token, so some rows may stop early; only tokens within length are compared.
  samples, prompts, lens = _sample(model, mesh, eos_id=5, **sampling)
  assert samples.tokens.shape == samples.logprobs.shape == (8, NEW)
  assert samples.tokens.dtype == np.int32 and samples.logprobs.dtype == np.float32
  logits = _trainer_logits(model, prompts, lens, samples)
  logprobs = jax.nn.log_softmax(logits / sampling["temperature"], axis=-1)
  expected = np.take_along_axis(np.asarray(logprobs), samples.tokens[..., None], axis=-1)[..., 0]
  mask = _response_mask(samples)
  # float32, both paths compute the same math in a different reduction order: tolerance 1e-4.
  np.testing.assert_allclose(samples.logprobs[mask], expected[mask], atol=1e-4)
  assert np.all(samples.logprobs[~mask] == 0) and np.all(samples.tokens[~mask] == PAD)
  assert np.all(samples.logprobs[mask] < 0)


def test_eos_stops_a_sequence(model, mesh):
  free, _, _ = _sample(model, mesh, seed=3)
  assert np.all(free.lengths == NEW)
  eos = int(free.tokens[0, 3])  # row 0 must stop at index 3 (or earlier, if eos came before)
  stopped, _, _ = _sample(model, mesh, seed=3, eos_id=eos)
  for b in range(8):
    hits = np.flatnonzero(free.tokens[b] == eos)
    length = hits[0] + 1 if hits.size else NEW
    assert stopped.lengths[b] == length
    # Identical draws until the end, then padding and zero log-probs.
    np.testing.assert_array_equal(stopped.tokens[b, :length], free.tokens[b, :length])
    np.testing.assert_allclose(stopped.logprobs[b, :length], free.logprobs[b, :length], atol=1e-6)
    assert np.all(stopped.tokens[b, length:] == PAD) and np.all(stopped.logprobs[b, length:] == 0)
  assert stopped.lengths[0] <= 4


def test_any_of_several_eos_ids_stops_a_sequence(model, mesh):
  # Llama-3 instruct stops on <|eot_id|> and <|end_of_text|>: the first of either ends a row.
  free, _, _ = _sample(model, mesh, seed=3)
  eos_a, eos_b = int(free.tokens[0, 2]), int(free.tokens[1, 4])
  stopped, _, _ = _sample(model, mesh, seed=3, eos_id=(eos_a, eos_b))
  for b in range(8):
    hits = np.flatnonzero(np.isin(free.tokens[b], [eos_a, eos_b]))
    length = hits[0] + 1 if hits.size else NEW
    assert stopped.lengths[b] == length
    np.testing.assert_array_equal(stopped.tokens[b, :length], free.tokens[b, :length])
  assert stopped.lengths[0] <= 3 and stopped.lengths[1] <= 5


def test_eos_ids_are_checked():
  from knitjax.rollout.sampler import eos_tuple

  assert eos_tuple(7) == (7,) and eos_tuple([3, 9]) == (3, 9)
  for bad in ([], [-1], (True,)):
    with pytest.raises(ValueError, match="eos ids"):
      eos_tuple(bad)


def test_greedy_follows_the_trainer_argmax_and_top_k_1_is_greedy(model, mesh):
  greedy, prompts, lens = _sample(model, mesh, temperature=0.0)
  logits = _trainer_logits(model, prompts, lens, greedy)
  np.testing.assert_array_equal(greedy.tokens, logits.argmax(-1))
  top1, _, _ = _sample(model, mesh, seed=7, top_k=1)
  np.testing.assert_array_equal(top1.tokens, greedy.tokens)
  tiny_p, _, _ = _sample(model, mesh, seed=8, top_p=1e-6)
  np.testing.assert_array_equal(tiny_p.tokens, greedy.tokens)


def test_top_k_and_top_p_draw_only_from_the_kept_tokens(model, mesh):
  top_k, prompts, lens = _sample(model, mesh, seed=1, temperature=2.0, top_k=3)
  logits = _trainer_logits(model, prompts, lens, top_k)
  chosen = np.take_along_axis(logits, top_k.tokens[..., None], axis=-1)
  rank = (logits > chosen).sum(-1)
  assert rank.max() < 3 and rank.max() > 0  # within the top 3, and not always the argmax

  top_p, prompts, lens = _sample(model, mesh, seed=2, temperature=2.0, top_p=0.3)
  probs = np.asarray(jax.nn.softmax(_trainer_logits(model, prompts, lens, top_p) / 2.0, axis=-1))
  chosen = np.take_along_axis(probs, top_p.tokens[..., None], axis=-1)
  mass_before = np.where(probs > chosen, probs, 0).sum(-1)  # mass of strictly likelier tokens
  assert mass_before.max() < 0.3 + 1e-5 and (mass_before > 0).any()


def test_keys_differ_per_shard_and_per_call(model, mesh):
  prompts, lens = _prompts()
  same = (np.repeat(prompts[:1], 8, axis=0), np.repeat(lens[:1], 8))
  a, _, _ = _sample(model, mesh, seed=0, prompts=same)
  b, _, _ = _sample(model, mesh, seed=0, prompts=same)
  c, _, _ = _sample(model, mesh, seed=1, prompts=same)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, c.tokens)
  # Same prompt on every row: rows of different shards (2 rows per shard) must not repeat.
  assert len({tuple(row) for row in a.tokens[::2]}) == 4


def test_bfloat16_sampler_stays_close_to_the_float32_trainer(model, mesh):
  graphdef, state = model
  bf16 = dataclasses.replace(TINY, dtype="bfloat16")
  bf16_graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(bf16, rngs=nnx.Rngs(0))))
  samples, prompts, lens = _sample((bf16_graphdef, state), mesh, temperature=1.0)
  logits = _trainer_logits(model, prompts, lens, samples)
  expected = np.take_along_axis(
    np.asarray(jax.nn.log_softmax(logits, axis=-1)), samples.tokens[..., None], axis=-1
  )[..., 0]
  # bfloat16 compute vs float32: measured max error ~0.06 on logits of std ~1.
  error = np.abs(samples.logprobs - expected)
  assert 0 < error.max() < 0.25


def test_bad_inputs_raise(model, mesh):
  graphdef, state = model
  sampler = Sampler(
    graphdef,
    mesh=mesh,
    sampling=SamplingConfig(max_new_tokens=4),
    eos_id=1,
    pad_id=PAD,
    prompt_len=PROMPT_LEN,
  )
  prompts, lens = _prompts()
  with pytest.raises(ValueError, match="divisible by the mesh's 4 batch shards"):
    sampler(state, prompts[:6], lens[:6], jax.random.key(0))
  with pytest.raises(ValueError, match="prompts must be"):
    sampler(state, prompts[:, :4], lens, jax.random.key(0))
  with pytest.raises(ValueError, match="prompt_lens"):
    sampler(state, prompts, np.zeros_like(lens), jax.random.key(0))


@pytest.mark.parametrize(
  "field, value",
  [("max_new_tokens", 0), ("temperature", -1.0), ("top_k", -2), ("top_p", 0.0)],
)
def test_sampling_config_rejects_bad_values(field, value):
  kwargs = {"max_new_tokens": 4, field: value}
  with pytest.raises(ValueError, match=field):
    SamplingConfig(**kwargs)


# Every temperature a run may be given, greedy (0) included: the log-probs the sampler and the
# continuous engine report are finite and <= 0 (the storage's payload check refuses anything else).
TEMPERATURES = [0.0, 1e-6, 0.01, 0.1, 0.5, 1.0, 2.0]


def _assert_storable(tokens, lengths, logprobs, prompt_len, vocab):
  from knitjax.transfer.validation import validate_payload

  mask = np.arange(tokens.shape[1])[None] < lengths[:, None]
  assert np.isfinite(logprobs).all() and (logprobs[mask] <= 0).all(), logprobs
  validate_payload(
    "g",
    dict(
      prompt_tokens=np.ones((len(tokens), prompt_len), np.int32),
      response_tokens=tokens,
      response_lengths=lengths,
      logprobs=logprobs,
      rewards=np.zeros(len(tokens), np.float32),
    ),
    0,
    vocab_size=vocab,
    max_seq_len=prompt_len + tokens.shape[1],
  )


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_every_temperature_gives_storable_logprobs(model, mesh, temperature):
  # Logits scaled up so that low temperatures push the tempered logits far apart, where float32
  # rounding put +1e-8 on the argmax token's log-prob and 1/T overflowed.
  graphdef, state = model
  loud = jax.tree.map(lambda x: x * 4.0, state)
  samples, _, _ = _sample((graphdef, loud), mesh, temperature=temperature)
  _assert_storable(samples.tokens, samples.lengths, samples.logprobs, PROMPT_LEN, 256)


def test_tiny_temperatures_sample_the_argmax(model, mesh):
  greedy, _, _ = _sample(model, mesh, temperature=0.0)
  tiny, _, _ = _sample(model, mesh, temperature=1e-6)
  np.testing.assert_array_equal(tiny.tokens, greedy.tokens)


def test_a_dominant_logit_is_drawn_with_log_prob_near_0_at_every_temperature():
  from knitjax.rollout.sampler import _sample as draw

  # The draw alone, outside a model (where XLA's fused exp/log put +1e-8 on such log-probs).
  logits = jax.numpy.asarray([[30.0, -5.0, 1e-3, 2.0]] * 4, jax.numpy.float32)
  for t in TEMPERATURES:
    tokens, lp = draw(logits, jax.random.key(0), SamplingConfig(max_new_tokens=1, temperature=t))
    assert (np.asarray(tokens) == 0).all()
    assert np.isfinite(lp).all() and (np.asarray(lp) <= 0).all() and (np.asarray(lp) > -1e-5).all()


@pytest.fixture(scope="module")
def engine_model():
  cfg = TransformerConfig(
    vocab_size=16, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, ffn_dim=64
  )
  engine_mesh = sharding.make_mesh((-1, 1, 1), devices=jax.devices()[:4])
  graphdef, params = sharding.init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), engine_mesh)
  return graphdef, jax.tree.map(lambda x: x * 4.0, params), engine_mesh


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_the_continuous_engine_gives_storable_logprobs_at_every_temperature(
  engine_model, temperature
):
  from knitjax.rollout.continuous import ContinuousEngine
  from knitjax.rollout.engine_requests import Request

  graphdef, params, engine_mesh = engine_model
  engine = ContinuousEngine(
    graphdef,
    mesh=engine_mesh,
    sampling=SamplingConfig(max_new_tokens=6, temperature=temperature),
    prompt_len=4,
    eos_id=2,
    pad_id=0,
    slots=8,
    refill_groups=1,
    prefill_chunk=0,
    decode_steps=6,
    adoption="mid_generation",
    param_slots=2,
  )
  engine.load(params, 0)
  rng = np.random.default_rng(0)
  pending = [
    Request(tag=k, tokens=rng.integers(3, 16, 4).astype(np.int32), max_new_tokens=6)
    for k in range(8)
  ]
  done, call = [], 0
  while (pending or engine.live_samples) and call < 50:
    start = pending[: engine.capacity(1)]
    del pending[: len(start)]
    done += engine.step(start, rng=jax.random.key(call), stop_free=4)
    call += 1
  assert len(done) == 8
  tokens = np.zeros((8, 6), np.int32)
  logprobs = np.zeros((8, 6), np.float32)
  lengths = np.zeros(8, np.int32)
  for i, f in enumerate(done):
    n = len(f.tokens)
    tokens[i, :n], logprobs[i, :n], lengths[i] = f.tokens, f.logprobs, n
  _assert_storable(tokens, lengths, logprobs, 4, 16)
