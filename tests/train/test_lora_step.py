"""The train step with LoRA: only adapters are optimized, the base is frozen and not donated,
the reference policy is the base, and the micro-batch split stays exact."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from knitjax import sharding
from knitjax.models import lora
from knitjax.models.transformer import Transformer
from knitjax.train import losses
from knitjax.train.batch import split_micro_batches
from knitjax.train.step import (
  StepHParams,
  batch_shardings,
  compile_train_step,
  host_metrics,
  init_train_state,
)

# The loss-menu step tests' tiny decoder and random mini-batch (same shapes).
from tests import tiny
from tests.tiny import N_NEW, TINY, random_minibatch

LORA = dataclasses.replace(TINY, lora_rank=4, lora_alpha=8.0)
LOSS = losses.LossConfig(entropy_coef=0.01, kl_coef=0.05, kl_estimator="k3")


@pytest.fixture(scope="module")
def mesh():
  return tiny.one_device_mesh()


@pytest.fixture(scope="module")
def model(mesh):
  """LoRA graphdef, trained-looking adapters (B != 0) and the frozen base."""
  graphdef, params = sharding.init_sharded(lambda: Transformer(LORA, rngs=nnx.Rngs(0)), mesh)
  adapters, base = lora.split(params)
  adapters = jax.tree.map(lambda x: x + 0.05, adapters)
  return graphdef, adapters, base


def _lora_step(mesh, model, micro_batches, tx, loss=LOSS):
  graphdef, adapters, base = model
  state, shardings = init_train_state(jax.tree.map(lambda x: x.copy(), adapters), tx, mesh)
  hp = StepHParams(loss=loss, max_new_tokens=N_NEW)
  step = compile_train_step(
    graphdef=graphdef, optimizer=tx, hparams=hp, state_shardings=shardings, mesh=mesh,
    frozen_shardings=sharding.state_shardings(base, mesh),
  )  # fmt: skip
  batch = jax.device_put(
    split_micro_batches(random_minibatch(), micro_batches), batch_shardings(mesh)
  )
  with jax.set_mesh(mesh):
    new_state, metrics = step(state, batch, base)
  return state, new_state, host_metrics(metrics)


def test_only_adapters_are_optimized_and_the_base_stays(mesh, model):
  _, adapters, base = model
  base_before = jax.device_get(base)
  tx = optax.adamw(1e-2)
  state, new_state, metrics = _lora_step(mesh, model, 2, tx)
  # The optimizer's moments have exactly the adapters' structure: no base param is optimized.
  mu = optax.tree_utils.tree_get(new_state.opt_state, "mu")
  assert jax.tree.structure(mu) == jax.tree.structure(adapters)
  assert lora.tree_bytes(new_state.opt_state) < 3 * lora.tree_bytes(adapters)
  # The base is an argument, not donated (still readable) and unchanged.
  assert not any(x.is_deleted() for x in jax.tree.leaves(base))
  assert all(jax.tree.leaves(jax.tree.map(np.array_equal, base, base_before)))
  # Every adapter moved (the state was donated: compare with the fixture's copy).
  moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), adapters, new_state.params)
  assert min(jax.tree.leaves(moved)) > 0
  assert metrics["kl"] != 0 and metrics["grad_norm"] > 0


def test_reference_policy_is_the_base(mesh, model):
  """LoRA's KL term equals a full fine-tuning step's whose params are the merged LoRA model and
  whose reference is the base: one forward of each policy, the same reference."""
  graphdef, adapters, base = model
  tx = optax.sgd(0.0)
  _, _, got = _lora_step(mesh, model, 1, tx)
  # A copy: merged shares the unadapted arrays (norms, embedding) with the base, and is donated.
  merged = jax.tree.map(lambda x: x.copy(), lora.merged(lora.combine(base, adapters)))
  plain_graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(TINY, rngs=nnx.Rngs(0))))[0]
  state, shardings = init_train_state(merged, tx, mesh)
  step = compile_train_step(
    graphdef=plain_graphdef, optimizer=tx, hparams=StepHParams(loss=LOSS, max_new_tokens=N_NEW),
    state_shardings=shardings, mesh=mesh, with_ref=True,
  )  # fmt: skip
  batch = jax.device_put(split_micro_batches(random_minibatch(), 1), batch_shardings(mesh))
  with jax.set_mesh(mesh):
    _, want = step(state, batch, base)
  want = host_metrics(want)
  assert got["kl"] > 1e-4  # the adapters moved the policy away from the base
  for key in ("loss", "kl", "ratio_mean", "entropy"):
    np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6)


def test_micro_batch_split_is_exact_with_lora(mesh, model):
  tx = optax.sgd(1.0)
  _, adapters, _ = model
  _, s1, m1 = _lora_step(mesh, model, 1, tx)
  _, s4, m4 = _lora_step(mesh, model, 4, tx)
  np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(m4["kl"], m1["kl"], rtol=1e-5, atol=1e-7)
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params), strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
