"""Consumer planning and per-consumer on-demand access."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitjax.train import losses
from knitjax.train.batch import split_micro_batches
from knitjax.train.step import (
  StepHParams,
  batch_shardings,
  compile_train_step,
  host_metrics,
  init_train_state,
)
from knitjax.transfer.access import RowSpec, consumer_batch, fetch_minibatch, to_global
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.consumer import plan_consumers
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.payload import synthetic_payload
from knitjax.transfer.storage import InProcessStorageUnit, StorageLimits
from tests import tiny
from tests.tiny import TINY


def _group(gid, tokens, unit, g=2):
  return GroupMeta(
    group_id=gid,
    cls="a",
    gen_version=0,
    num_samples=g,
    prompt_tokens=(1,) * g,
    response_tokens=tuple(tokens),
    storage_unit=unit,
  )


@st.composite
def _minibatches(draw):
  consumers = draw(st.integers(1, 4))
  n = consumers * draw(st.integers(1, 4))
  units = draw(st.integers(1, 4))
  groups = tuple(
    _group(
      i, draw(st.lists(st.integers(0, 50), min_size=2, max_size=2)), draw(st.integers(0, units - 1))
    )
    for i in range(n)
  )
  return MiniBatch(0, 0, groups), consumers


@settings(max_examples=150, deadline=None)
@given(_minibatches(), st.sampled_from([0.0, 0.5, 1e9]))
def test_plan_gives_every_group_once_in_equal_counts(case, slack):
  mb, consumers = case
  plan = plan_consumers(mb, consumers, locality_slack=slack)
  got = [g.group_id for part in plan.groups for g in part]
  assert sorted(got) == [g.group_id for g in mb.groups]  # each group exactly once
  assert {len(part) for part in plan.groups} == {len(mb.groups) // consumers}
  for part in plan.groups:  # mini-batch order within a consumer
    ids = [g.group_id for g in part]
    assert ids == sorted(ids)
  tokens = [sum(g.prompt_tokens) + sum(g.response_tokens) for g in mb.groups]
  loads = [sum(sum(g.prompt_tokens) + sum(g.response_tokens) for g in p) for p in plan.groups]
  if slack == 0.0:  # balance first: no consumer exceeds another by more than one group
    assert max(loads) - min(loads) <= max(tokens)
  home = [sum(g.storage_unit % consumers == c for g in mb.groups) for c in range(consumers)]
  if slack == 1e9:  # locality first: as many local groups as the equal counts allow
    cap = len(mb.groups) // consumers
    assert sum(plan.home) == sum(min(h, cap) for h in home)
  assert plan_consumers(mb, consumers, locality_slack=slack) == plan  # deterministic


def test_plan_keeps_local_groups_home_and_reports_it():
  groups = tuple(_group(i, (5, 5), unit=i % 2) for i in range(8))
  plan = plan_consumers(MiniBatch(3, 1, groups), 2)
  assert [[g.storage_unit for g in p] for p in plan.groups] == [[0] * 4, [1] * 4]
  assert plan.stats() == {"local_fraction": 1.0, "token_imbalance": 1.0}
  part = plan.minibatch_for(1)
  assert (part.step, part.index, len(part.groups)) == (3, 1, 4)


def test_plan_rejects_uneven_split():
  groups = tuple(_group(i, (1, 1), 0) for i in range(6))
  with pytest.raises(ValueError, match="6 groups cannot be split over 4 consumers"):
    plan_consumers(MiniBatch(0, 0, groups), 4)
  with pytest.raises(ValueError, match="locality_slack"):
    plan_consumers(MiniBatch(0, 0, groups), 2, locality_slack=-1)


CFG = TINY  # tests/tiny.py
P_LEN, N_NEW, G = 4, 5, 2
ROW_SPEC = RowSpec(estimator="grpo", prompt_len=P_LEN, max_new_tokens=N_NEW, pad_id=0)


def _stored_minibatch(num_groups=8, units=2):
  """Random groups written to ``units`` storage units, and their released mini-batch."""
  rng = np.random.default_rng(0)
  limits = StorageLimits(vocab_size=32, max_seq_len=P_LEN + N_NEW, max_bytes=1 << 20)
  storage = {u: InProcessStorageUnit(limits, unit_id=u) for u in range(units)}
  metas = []
  for gid in range(num_groups):
    payload = synthetic_payload(
      rng, group_size=G, prompt_len=P_LEN, response_len=N_NEW, vocab_size=32
    )
    lens = payload["response_lengths"]
    unit = gid % units
    storage[unit].put(gid, payload)
    metas.append(_group(gid, lens.tolist(), unit, g=G))
  return MiniBatch(0, 0, tuple(metas)), storage


def _assemble(parts, k):
  """The global [K, rows/K] arrays: micro-batch k is every consumer's k-th slice in order."""
  split = [split_micro_batches(p, k) for p in parts]
  return {f: np.concatenate([s[f] for s in split], axis=1) for f in split[0]}


def test_consumers_fetch_only_their_groups_and_the_update_is_unchanged():
  """C consumers each fetch their part; together they give the whole mini-batch's update."""
  mb, storage = _stored_minibatch()
  k, consumers = 2, 2
  whole, _ = fetch_minibatch(mb, storage, ROW_SPEC)
  parts, infos = zip(
    *[
      consumer_batch(
        mb, storage, row_spec=ROW_SPEC, consumer=c, num_consumers=consumers, locality_slack=1e9
      )
      for c in range(consumers)
    ],
    strict=True,
  )
  for c, part in enumerate(parts):  # rows of 4 groups each, all from the consumer's own unit
    assert len(part["advantages"]) == len(mb.groups) * G // consumers
    assert infos[c]["local_fraction"] == 1.0
  assembled = _assemble(parts, k)
  flat = {f: v.reshape(-1, *v.shape[2:]) for f, v in assembled.items()}
  key = lambda b, i: b["tokens"][i].tobytes() + b["advantages"][i].tobytes()  # noqa: E731
  assert sorted(key(flat, i) for i in range(16)) == sorted(key(whole, i) for i in range(16))

  mesh = tiny.one_device_mesh()
  results = []
  for batch in (split_micro_batches(whole, k), assembled):
    graphdef, params = tiny.init(CFG, mesh)
    state, shardings = init_train_state(params, optax.sgd(1.0), mesh)
    step = compile_train_step(
      graphdef=graphdef,
      optimizer=optax.sgd(1.0),
      hparams=StepHParams(loss=losses.LossConfig(), max_new_tokens=N_NEW),
      state_shardings=shardings,
      mesh=mesh,
    )
    with jax.set_mesh(mesh):
      state, m = step(state, to_global(batch, batch_shardings(mesh)))
    results.append((host_metrics(m)["loss"], jax.device_get(state.params)))
  np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[1][1]), strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_consumers_report_the_whole_minibatch_rewards():
  """Each consumer fetches only its rows, but its reward metrics are the mini-batch's."""
  rng = np.random.default_rng(3)
  limits = StorageLimits(vocab_size=32, max_seq_len=P_LEN + N_NEW, max_bytes=1 << 20)
  storage = {u: InProcessStorageUnit(limits, unit_id=u) for u in range(2)}
  metas = []
  for gid in range(8):
    payload = synthetic_payload(
      rng, group_size=G, prompt_len=P_LEN, response_len=N_NEW, vocab_size=32
    )
    payload["rewards"] = rng.choice([0.0, 1.0], size=G).astype(np.float32)
    if gid % 3 == 0:
      payload["rewards"][:] = 1.0  # a group without signal
    storage[gid % 2].put(gid, payload)
    r = payload["rewards"].astype(np.float64)
    meta = _group(gid, payload["response_lengths"].tolist(), gid % 2, g=G)
    metas.append(dataclasses.replace(meta, reward_mean=r.mean(), reward_std=r.std()))
  mb = MiniBatch(0, 0, tuple(metas))
  _, whole = fetch_minibatch(mb, storage, ROW_SPEC)
  for c in range(2):
    _, info = consumer_batch(
      mb, storage, row_spec=ROW_SPEC, consumer=c, num_consumers=2, locality_slack=1e9
    )
    for k in ("reward_mean", "reward_std", "signal_groups"):
      assert info[k] == pytest.approx(whole[k], abs=1e-6), k
