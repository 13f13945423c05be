"""Continuous batching engine: exact log-probs per slot, out-of-order finishes, versions, chunked
prefill interleaved with decoding, one prefill per shared prompt, groups split over shards."""

import jax
import numpy as np
import pytest
from flax import nnx

from knitjax import sharding
from knitjax.models.transformer import Transformer, TransformerConfig
from knitjax.rollout.continuous import ContinuousEngine
from knitjax.rollout.engine_requests import Request
from knitjax.rollout.engine_state import Outbox, ended_rows
from knitjax.rollout.sampler import SamplingConfig
from knitjax.train.batch import make_batch, pad_rows
from knitjax.train.step import sequence_logprobs

P, N = 6, 10
EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def model():
  cfg = TransformerConfig(
    vocab_size=16, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, ffn_dim=64
  )
  mesh = sharding.make_mesh((-1, 1, 1), devices=jax.devices()[:4])
  graphdef, params = sharding.init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
  # A second version: every param nudged, so the two policies differ measurably.
  params2 = jax.tree.map(lambda x: x * 1.5, params)
  return graphdef, params, params2, mesh


# The engine's settings these tests start from (a run takes them from the config): whole-prompt
# prefill, unless a test says otherwise.
SETTINGS = dict(
  refill_groups=1,
  prefill_chunk=0,
  decode_steps=8,
  adoption="mid_generation",
  param_slots=2,
)


def _new_engine(model, temperature=1.0, **kw):
  graphdef, _, _, mesh = model
  return ContinuousEngine(
    graphdef,
    mesh=mesh,
    sampling=SamplingConfig(max_new_tokens=N, temperature=temperature),
    prompt_len=P,
    eos_id=EOS,
    pad_id=PAD,
    **{**SETTINGS, "slots": 8, **kw},
  )


def _engine(model, **kw):
  return _new_engine(model, **{"decode_steps": 3, **kw})


def _requests(start, n, rng, budget=None):
  out = []
  for k in range(n):
    length = int(rng.integers(1, P + 1))
    toks = np.concatenate([[1], rng.integers(3, 16, length - 1)]).astype(np.int32)
    out.append(
      Request(tag=start + k, tokens=toks, max_new_tokens=budget or int(rng.integers(1, N + 1)))
    )
  return out


def _teacher_forced(graphdef, params, reqs, done):
  batch = make_batch(
    pad_rows(
      [reqs[f.tag].tokens for f in done], [f.tokens for f in done], [f.logprobs for f in done]
    ),
    np.zeros(len(done)),
    prompt_len=P,
    max_new_tokens=N,
    pad_id=PAD,
  )
  logp, _ = sequence_logprobs(graphdef, params, batch, 1.0)
  mask = batch["loss_mask"] > 0
  return np.asarray(logp)[mask], batch["behavior_logp"][mask]


def _drain(engine, reqs, pending, rng_seed=0, limit=200, on_call=None):
  done, call = [], 0
  while (pending or engine.live_samples) and call < limit:
    start = pending[: engine.capacity(1)]
    del pending[: len(start)]
    done += engine.step(start, rng=jax.random.key(rng_seed + call), stop_free=4)
    call += 1
    if on_call is not None:
      on_call(call)
  return done


def test_logprobs_match_the_trainer_and_budgets_hold(model):
  graphdef, params, _, _ = model
  engine = _engine(model)
  engine.load(params, 0)
  rng = np.random.default_rng(0)
  reqs = {r.tag: r for r in _requests(0, 40, rng)}
  done = _drain(engine, reqs, list(reqs.values()))
  assert sorted(f.tag for f in done) == list(range(40))  # every request finished once
  for f in done:
    n = len(f.tokens)
    assert 1 <= n <= reqs[f.tag].max_new_tokens
    assert (f.tokens[:-1] != EOS).all()  # only the last token may be the EOS
    assert n == reqs[f.tag].max_new_tokens or f.tokens[-1] == EOS
  # Each slot decodes at its own position over its own cache row: the trainer's teacher-forced
  # log-probs of the same tokens agree.
  got, want = _teacher_forced(graphdef, params, reqs, done)
  np.testing.assert_allclose(got, want, atol=1e-4)
  assert engine.free_slots == engine.slots


def test_slots_are_refilled_while_long_samples_run(model):
  _, params, _, _ = model
  engine = _engine(model, slots=8, refill_groups=1, decode_steps=2)
  engine.load(params, 0)
  rng = np.random.default_rng(1)
  # Four long samples, then a stream of one-token samples that must overtake them.
  long = _requests(0, 4, rng, budget=N)
  short = _requests(100, 12, rng, budget=1)
  reqs = {r.tag: r for r in long + short}
  order = [f.tag for f in _drain(engine, reqs, long + short)]
  last_short = max(order.index(t) for t in range(100, 112))
  long_left = [t for t in range(4) if order.index(t) > last_short]
  assert len(order) == 16
  # Short samples started after the long ones finish first: out of order, in reused slots.
  assert long_left, order


def test_new_groups_keep_their_version_mid_generation_switches(model):
  graphdef, params, params2, _ = model
  rng = np.random.default_rng(2)
  first = _requests(0, 4, rng, budget=N)
  second = _requests(100, 4, rng, budget=N)
  reqs = {r.tag: r for r in first + second}

  engine = _engine(model, adoption="new_groups", param_slots=2)
  engine.load(params, 0)
  done = engine.step(first, rng=jax.random.key(0), stop_free=0)
  engine.load(params2, 1)  # a param slot is free: adopted for new samples only
  assert engine.version == 1
  done += _drain(engine, reqs, list(second))
  by_version = {v: [f for f in done if f.version == v] for v in (0, 1)}
  assert sorted(f.tag for f in by_version[0]) == [0, 1, 2, 3]
  assert all(f.version_newest == f.version for f in done)
  for v, p in ((0, params), (1, params2)):
    got, want = _teacher_forced(graphdef, p, reqs, by_version[v])
    np.testing.assert_allclose(got, want, atol=1e-4)

  engine = _engine(model, adoption="mid_generation")
  engine.load(params, 0)
  done = engine.step(first, rng=jax.random.key(0), stop_free=0)
  live = {r.tag for r in first} - {f.tag for f in done}
  engine.load(params2, 1)
  done += _drain(engine, reqs, [])
  switched = [f for f in done if f.tag in live]
  assert switched and all((f.version, f.version_newest) == (0, 1) for f in switched)


def test_new_groups_waits_for_a_free_param_slot(model):
  _, params, params2, _ = model
  engine = _engine(model, adoption="new_groups", param_slots=2, decode_steps=1)
  rng = np.random.default_rng(3)
  engine.load(params, 0)
  first, second = _requests(0, 4, rng, budget=N), _requests(4, 4, rng, budget=N)
  done = engine.step(first, rng=jax.random.key(0), stop_free=0)
  engine.load(params2, 1)
  done += engine.step(second, rng=jax.random.key(1), stop_free=0)
  finished = {f.tag for f in done}
  assert not {0, 1, 2, 3} <= finished and not {4, 5, 6, 7} <= finished  # both versions live
  engine.load(params, 2)  # no param slot is free: new samples keep starting at version 1
  assert engine.version == 1
  reqs = {r.tag: r for r in first + second}
  done += _drain(engine, reqs, [])
  engine.step([], rng=jax.random.key(2), stop_free=0)
  assert engine.version == 2  # adopted once a param slot emptied
  assert {f.tag: f.version for f in done} == {t: int(t >= 4) for t in range(8)}


def test_bad_requests_and_settings_are_rejected(model):
  engine = _engine(model)
  with pytest.raises(RuntimeError, match="no weights"):
    engine.step([], rng=jax.random.key(0), stop_free=0)
  engine.load(model[1], 0)
  bad = Request(tag=0, tokens=np.ones(P + 1, np.int32), max_new_tokens=2)
  with pytest.raises(ValueError, match="prompt of 7 tokens"):
    engine.step([bad], rng=jax.random.key(0), stop_free=0)
  too_many = _requests(0, 5, np.random.default_rng(0))
  with pytest.raises(ValueError, match="do not fit"):
    engine.step(too_many, rng=jax.random.key(0), stop_free=0)
  with pytest.raises(ValueError, match="multiple of the 4 batch shards"):
    _engine(model, slots=6)
  with pytest.raises(ValueError, match="param_slots"):
    _engine(model, adoption="new_groups", param_slots=1)


def _group(tag0, n, tokens, budget):
  return [Request(tag=tag0 + k, tokens=tokens, max_new_tokens=budget) for k in range(n)]


@pytest.mark.parametrize("chunk", [1, 4, 0])
def test_chunked_shared_prefill_keeps_logprobs_exact(model, chunk):
  """Groups of G samples on one prompt, prefilled in chunks once per shard share: the trainer's
  teacher-forced log-probs of every sample agree, and each share is prefilled once."""
  graphdef, params, _, _ = model
  engine = _engine(model, slots=16, prefill_chunk=chunk, decode_steps=2)
  engine.load(params, 0)
  rng = np.random.default_rng(4)
  prompts = [r.tokens for r in _requests(0, 6, rng)]
  groups = [_group(10 * g, 4, prompts[g], int(rng.integers(2, N + 1))) for g in range(6)]
  reqs = {r.tag: r for grp in groups for r in grp}
  done, call, pending = [], 0, list(groups)
  while (pending or engine.live_samples) and call < 200:
    while pending and engine.capacity(4):
      start = pending.pop(0)
      done += engine.step(start, rng=jax.random.key(100 + call), stop_free=4)
      call += 1
    done += engine.step([], rng=jax.random.key(100 + call), stop_free=4)
    call += 1
  assert sorted(f.tag for f in done) == sorted(reqs)
  # 4 slots per shard: each group of 4 lands on one shard and is prefilled once.
  assert engine.prefills == 6
  if chunk == 1:
    assert engine.chunk_passes >= 6  # at least one chunk per prompt token of the longest
  got, want = _teacher_forced(graphdef, params, reqs, done)
  np.testing.assert_allclose(got, want, atol=1e-4)


def test_chunked_and_whole_prefill_give_the_same_greedy_samples(model):
  graphdef, params, _, mesh = model
  rng = np.random.default_rng(5)
  prompts = [r.tokens for r in _requests(0, 4, rng)]
  out = {}
  for chunk, share in ((0, False), (0, True), (2, True), (1, True)):
    engine = _new_engine(
      model, temperature=0.0, slots=16, refill_groups=4, prefill_chunk=chunk, share_prefix=share
    )
    engine.load(params, 0)
    reqs = [r for g in range(4) for r in _group(10 * g, 4, prompts[g], N)]
    done = engine.step(reqs, rng=jax.random.key(0), stop_free=0)
    done += _drain(engine, {r.tag: r for r in reqs}, [])
    out[chunk, share] = {f.tag: f for f in done}
    assert engine.prefills == (16 if not share else 4)
  ref = out[0, False]
  for key, got in out.items():
    for tag, f in ref.items():
      np.testing.assert_array_equal(got[tag].tokens, f.tokens, err_msg=str(key))
      np.testing.assert_allclose(got[tag].logprobs, f.logprobs, atol=1e-5, err_msg=str(key))


def test_a_group_larger_than_a_shard_is_split_over_shards(model):
  graphdef, params, _, _ = model
  engine = _engine(model, slots=8, prefill_chunk=2)  # 2 slots on each of 4 shards
  engine.load(params, 0)
  rng = np.random.default_rng(6)
  grp = _group(0, 6, _requests(0, 1, rng)[0].tokens, N)
  assert engine.capacity(6) == 1 and engine.capacity(8) == 1 and engine.capacity(2) == 4
  done = engine.step(grp, rng=jax.random.key(0), stop_free=0)
  assert engine.prefills == 3  # one lane on each of 3 shards, each prefilling the prompt once
  assert engine.capacity(2) == 1  # one shard, one lane left
  done += _drain(engine, {r.tag: r for r in grp}, [])
  got, want = _teacher_forced(graphdef, params, {r.tag: r for r in grp}, done)
  np.testing.assert_allclose(got, want, atol=1e-4)


def test_group_starts_do_not_stall_live_slots(model):
  """While a new prompt is prefilled chunk by chunk, the live slots decode in every iteration."""
  _, params, _, _ = model
  engine = _engine(model, slots=8, prefill_chunk=1, decode_steps=3)
  engine.load(params, 0)
  first = _group(0, 2, np.asarray([1, 3, 4], np.int32), N)  # 3 chunks of 1 token
  engine.step(first, rng=jax.random.key(0), stop_free=0)  # 3 iterations: 3 chunks
  # The last chunk's iteration samples the first tokens and decodes the second in the same pass.
  assert engine.chunk_passes == 3 and engine.decode_passes == 1
  second = _group(10, 2, np.asarray([1, 5, 6, 7, 8, 9], np.int32), N)  # 6 chunks
  engine.step(second, rng=jax.random.key(1), stop_free=0)
  # The first group decodes in every iteration of the call that prefills the second.
  assert engine.chunk_passes == 6 and engine.decode_passes == 4
  assert engine.live_samples == 4 and engine.free_slots == 4


def test_split_by_version_runs_each_versions_rows_in_its_smallest_bucket():
  from knitjax.rollout.version_split import buckets, split_by_version

  assert buckets(16) == (2, 4, 8, 16)
  assert buckets(3) == (1, 2, 3)

  def fn(scale, rows):
    x = jax.numpy.arange(16.0)
    return ((x if rows is None else x[rows]) * scale,)

  which = np.array([0] * 13 + [1] * 3)
  active = np.arange(16) != 5
  (out,), rows, unsplit = jax.jit(
    lambda w, a: split_by_version([10.0, 100.0], w, a, fn, (np.full(16, -1.0),))
  )(which, active)
  want = np.where(which == 0, np.arange(16.0) * 10, np.arange(16.0) * 100)
  want[5] = -1.0  # not active: untouched
  np.testing.assert_array_equal(out, want)
  assert int(rows) == 16 + 4  # 12 rows of version 0: every slot; 3 of version 1: a bucket of 4
  assert int(unsplit) == 16 + 16  # the old rule: a pass over every slot per version


def test_a_version_transition_decodes_each_versions_rows_once(model):
  """Mostly version-0 rows and a few version-1 rows: log-probs exact per version, and the decode
  computes far fewer rows than one full pass per version."""
  graphdef, params, params2, _ = model
  rng = np.random.default_rng(5)
  first = _requests(0, 14, rng, budget=N)
  second = _requests(100, 2, rng, budget=N)
  reqs = {r.tag: r for r in first + second}
  engine = _engine(
    model, adoption="new_groups", param_slots=2, slots=16, refill_groups=4, decode_steps=2
  )
  engine.load(params, 0)
  done = engine.step(first, rng=jax.random.key(0), stop_free=0)
  engine.load(params2, 1)
  before = (engine.rows_decoded, engine.rows_unsplit)
  done += _drain(engine, reqs, list(second))
  by_version = {v: [f for f in done if f.version == v] for v in (0, 1)}
  assert sorted(f.tag for f in by_version[1]) == [100, 101]
  for v, p in ((0, params), (1, params2)):
    got, want = _teacher_forced(graphdef, p, reqs, by_version[v])
    np.testing.assert_allclose(got, want, atol=1e-4)
  rows, unsplit = engine.rows_decoded - before[0], engine.rows_unsplit - before[1]
  print(f"rows decoded {rows}; one pass per live version: {unsplit}")
  assert rows < 0.8 * unsplit, (rows, unsplit)


def test_harvest_reads_only_the_outbox_rows_asked_for_in_their_order():
  mesh = sharding.make_mesh((-1, 1, 1), devices=jax.devices()[:4])
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 16, size=(8, 5)).astype(np.int32)
  logprobs = rng.normal(size=(8, 5)).astype(np.float32)
  length = rng.integers(1, 6, size=(8,)).astype(np.int32)
  tag = rng.permutation(8).astype(np.int32)
  put = lambda x: jax.device_put(x, sharding.batch_sharding(mesh, x.ndim))  # noqa: E731
  out = Outbox(
    tokens=put(tokens),
    logprobs=put(logprobs),
    length=put(length),
    tag=put(tag),
    count=put(np.full(4, 2, np.int32)),
  )
  for rows in ([5], [6, 1, 3], [7, 0, 2, 4, 1]):  # 1, 4 (padded from 3) and 8 (from 5) rows
    got = ended_rows(out, rows)
    assert [g.shape[0] for g in got] == [len(rows)] * 4
    for g, want in zip(got, (tokens, logprobs, length, tag), strict=True):
      np.testing.assert_array_equal(g, want[rows])


def test_launch_runs_while_the_host_goes_on_and_collect_keeps_the_launch_version(model):
  graphdef, params, params2, mesh = model
  engine = _engine(model)
  engine.load(params, 0)
  assert engine.collect() == [] and not engine.in_flight
  reqs = _requests(0, 4, np.random.default_rng(3), budget=2)
  engine.launch(reqs, rng=jax.random.key(0), stop_free=0)
  assert engine.in_flight and engine.free_slots == 4  # taken until collected
  with pytest.raises(RuntimeError, match="collect"):
    engine.launch([], rng=jax.random.key(1), stop_free=0)
  engine.load(params2, 1)  # mid-generation: the running call still decodes with version 0
  done = engine.collect()
  assert sorted(f.tag for f in done) == [0, 1, 2, 3]
  assert all(f.version == 0 and f.version_newest == 0 for f in done)
  got, want = _teacher_forced(graphdef, params, reqs, done)
  np.testing.assert_allclose(got, want, atol=2e-5)


def test_the_call_timeline_keeps_the_newest_rows_only(model, monkeypatch):
  from knitjax.rollout import continuous

  _, params, _, _ = model
  monkeypatch.setattr(continuous, "TIMELINE_ROWS", 2)
  engine = _engine(model)
  engine.load(params, 0)
  reqs = _requests(0, 8, np.random.default_rng(9), budget=N)
  _drain(engine, {r.tag: r for r in reqs}, list(reqs))
  assert engine.calls > 2 and len(engine.timeline) == 2  # bounded memory in long runs
  assert engine.timeline[0][0] < engine.timeline[1][0]  # in launch order
