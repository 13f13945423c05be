"""The one rollout contract: batched sampler and continuous engine behave alike behind it."""

import jax
import numpy as np
import pytest
from flax import nnx

from knitjax import sharding
from knitjax.models.transformer import Transformer, TransformerConfig
from knitjax.rollout import contract
from knitjax.rollout.continuous import ContinuousEngine
from knitjax.rollout.sampler import Sampler, SamplingConfig
from knitjax.rollout.streaming import StreamingRollout
from knitjax.rollout.worker import BatchedRollout, RolloutWorker
from knitjax.tasks import arith
from knitjax.tasks.rewards import get_reward_fn
from knitjax.transfer.storage import InProcessStorageUnit, StorageLimits

G, N = 4, 3


@pytest.fixture(scope="module")
def parts():
  source, tok = arith.make_source(seed=0, cls="arith")
  cfg = TransformerConfig(
    vocab_size=tok.vocab_size,
    num_layers=1,
    d_model=32,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    ffn_dim=64,
  )
  mesh = sharding.make_mesh((-1, 1, 1), devices=jax.devices()[:2])
  graphdef, params = sharding.init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
  prompt_len = max(len(p.tokens) for p in source.next(100))
  return source, tok, graphdef, params, mesh, prompt_len


def _unit(tok, prompt_len):
  return InProcessStorageUnit(
    StorageLimits(vocab_size=tok.vocab_size, max_seq_len=prompt_len + N, max_bytes=1 << 22)
  )


def _batched(parts, max_groups=None):
  _, tok, graphdef, _, mesh, prompt_len = parts
  sampler = Sampler(
    graphdef,
    mesh=mesh,
    sampling=SamplingConfig(max_new_tokens=N),
    eos_id=tok.eos_id,
    pad_id=tok.pad_id,
    prompt_len=prompt_len,
  )
  worker = RolloutWorker(
    sampler=sampler,
    tokenizer=tok,
    reward_fn=get_reward_fn("arith_exact"),
    group_size=G,
    prompt_len=prompt_len,
  )
  return BatchedRollout(worker, _unit(tok, prompt_len), max_groups=max_groups)


def _streaming(parts, *, temperature=1.0):
  _, tok, graphdef, _, mesh, prompt_len = parts
  engine = ContinuousEngine(
    graphdef,
    mesh=mesh,
    sampling=SamplingConfig(max_new_tokens=N, temperature=temperature),
    slots=2 * G,
    prompt_len=prompt_len,
    eos_id=tok.eos_id,
    pad_id=tok.pad_id,
    refill_groups=1,
    prefill_chunk=0,
    decode_steps=2,
    adoption="new_groups",
    param_slots=2,
  )
  return StreamingRollout(
    engine,
    _unit(tok, prompt_len),
    reward_fn=get_reward_fn("arith_exact"),
    tokenizer=tok,
    group_size=G,
  )


@pytest.mark.parametrize("make", [_batched, _streaming], ids=["batched", "continuous"])
def test_generate_returns_complete_groups_in_prompt_order_with_payloads_stored(parts, make):
  source, _, _, params, mesh, _ = parts
  rollout = make(parts)
  assert isinstance(rollout, contract.Rollout)
  with pytest.raises(RuntimeError, match="adopt"):
    rollout.start(source.next(1)[0], 0)
  prompts = source.next(5)
  with jax.set_mesh(mesh):
    metas = contract.generate(
      rollout, params, prompts, version=3, rng=jax.random.key(0), first_group_id=10
    )
  assert [m.group_id for m in metas] == list(range(10, 15))
  assert [m.cls for m in metas] == ["arith"] * 5
  assert all(m.gen_version == 3 and m.num_samples == G for m in metas)
  assert rollout.inflight == 0 and rollout.version == 3
  (unit,) = rollout.storage.values()
  payloads = unit.get([m.group_id for m in metas])
  for meta, payload, prompt in zip(metas, payloads, prompts, strict=True):
    assert tuple(payload.response_lengths) == meta.response_tokens
    assert all(1 <= n <= N for n in meta.response_tokens)
    np.testing.assert_array_equal(payload.prompt_tokens[0, : len(prompt.tokens)], prompt.tokens)
    assert np.isclose(payload.rewards.mean(), meta.reward_mean)
  assert rollout.stats().tokens == sum(sum(m.response_tokens) for m in metas)


def test_batched_capacity_bounds_a_wave(parts):
  source, _, _, params, mesh, _ = parts
  rollout = _batched(parts, max_groups=2)
  rollout.adopt(params, 0)
  assert rollout.capacity() == 2
  rollout.start(source.next(1)[0], 0)
  rollout.start(source.next(1)[0], 1)
  assert rollout.capacity() == 0 and rollout.inflight == 2
  with jax.set_mesh(mesh):
    metas = rollout.step(jax.random.key(1))
  assert [m.group_id for m in metas] == [0, 1] and rollout.capacity() == 2
  assert rollout.step(jax.random.key(2)) == []
