"""Train step: exact micro-batch accumulation, and sharded == single-device."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from knitjax import sharding
from knitjax.models.transformer import Transformer
from knitjax.train import losses
from knitjax.train.step import StepHParams, batch_shardings, init_train_state
from tests import tiny
from tests.tiny import N_NEW, ROWS, TINY, random_minibatch


def run_step(mesh, batch, micro_batches, *, aggregation="token_mean", tx=None, kl=0.0):
  hp = StepHParams(
    loss=losses.LossConfig(aggregation=aggregation, eps_high=0.28, kl_coef=kl, entropy_coef=0.01),
    max_new_tokens=N_NEW,
  )
  ref_scale = 0.9 if kl > 0 else None
  return tiny.train_step(mesh, batch, hp, micro_batches=micro_batches, tx=tx, ref_scale=ref_scale)


# seq_mean_token_sum is dr_grpo under its older name (the same function): not compiled twice.
@pytest.mark.parametrize(
  "aggregation", [a for a in losses.AGGREGATIONS if a != "seq_mean_token_sum"]
)
def test_micro_batch_split_is_exact(aggregation):
  """Loss and gradient of a mini-batch do not depend on its split into micro-batches."""
  mesh = tiny.one_device_mesh()
  batch = random_minibatch()
  before, p1, m1 = run_step(mesh, batch, 1, aggregation=aggregation)
  grads1 = tiny.gradient(before, p1)
  for k in (4,):  # uneven token counts per micro-batch; 1 vs 4 keeps compiles few
    _, pk, mk = run_step(mesh, batch, k, aggregation=aggregation)
    np.testing.assert_allclose(mk["loss"], m1["loss"], rtol=1e-5, atol=1e-7)
    tiny.assert_trees_close(tiny.gradient(before, pk), grads1, rtol=1e-4, atol=1e-6)
    assert mk["num_tokens"] == m1["num_tokens"] == batch["loss_mask"].sum()
    np.testing.assert_allclose(mk["clip_frac"], m1["clip_frac"], atol=1e-6)


def test_per_micro_batch_token_mean_would_differ():
  """The peer scheme (average of per-micro-batch token means) is a different objective."""
  batch = random_minibatch(seed=1)
  mask = batch["loss_mask"]
  per_token = np.arange(mask.size, dtype=np.float32).reshape(mask.shape) % 7
  whole = (per_token * mask).sum() / mask.sum()
  halves = [
    (per_token[s] * mask[s]).sum() / mask[s].sum()
    for s in (slice(0, ROWS // 2), slice(ROWS // 2, None))
  ]
  assert abs(np.mean(halves) - whole) > 1e-3
  # ...whereas the mini-batch Normalizer makes micro-batch contributions sum to the whole.
  norm = losses.Normalizer.from_mask(mask, max_len=N_NEW)
  parts = [
    losses.aggregate(per_token[s], mask[s], aggregation="token_mean", norm=norm)
    for s in (slice(0, ROWS // 2), slice(ROWS // 2, None))
  ]
  np.testing.assert_allclose(float(sum(parts)), whole, rtol=1e-6)


def test_sharded_step_matches_single_device():
  """(2,2,2) mesh on 8 fake devices == 1 device: loss and updated params.

  Tolerances: loss rtol 1e-5; params rtol 1e-5 / atol 1e-6 under clipped SGD (linear in the
  gradient, so it shows gradient agreement directly). AdamW's normalisation turns float32
  reduction-order noise in near-zero gradients into ~1e-5 param differences, so under AdamW
  params are compared at atol 1e-4 (updates are ~1e-2).
  """
  batch = random_minibatch(seed=2, rows=16)
  mesh1 = tiny.one_device_mesh()
  mesh8 = sharding.make_mesh((2, 2, 2))
  for tx, atol in (
    (optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), 1e-6),
    (optax.adamw(1e-2, weight_decay=0.01), 1e-4),
  ):
    _, p1, m1 = run_step(mesh1, batch, 2, tx=tx, kl=0.05)
    _, p8, m8 = run_step(mesh8, batch, 2, tx=tx, kl=0.05)
    np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m8["kl"], m1["kl"], rtol=1e-4, atol=1e-7)
    tiny.assert_trees_close(p8, p1, rtol=1e-5, atol=atol)


def test_state_is_sharded_on_fsdp_tensor_mesh():
  mesh = sharding.make_mesh((2, 2, 2))
  cfg = dataclasses.replace(TINY, num_layers=2, d_model=128, ffn_dim=256, vocab_size=256)
  _, params = sharding.init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
  state, _ = init_train_state(params, optax.adamw(1e-3), mesh)
  sharding.assert_params_sharded(state.params, mesh, min_size=4096)
  sharding.assert_params_sharded(state.opt_state, mesh, min_size=4096)


def test_batch_rows_follow_the_batch_rule():
  mesh = sharding.make_mesh((2, 2, 2))
  specs = {k: s.spec for k, s in batch_shardings(mesh).items()}
  assert set(specs.values()) == {jax.sharding.PartitionSpec(None, ("data", "fsdp"))}
