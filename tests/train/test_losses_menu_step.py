"""The loss menu through the real train step: the micro-batch split stays exact in every mode.

GSPO's sequence ratio needs each row's whole response in one micro-batch; the step's micro-batch
split keeps rows whole, so the mini-batch's loss and gradient do not depend on the split.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from knitjax import sharding
from knitjax.models.transformer import Transformer, TransformerConfig
from knitjax.train import losses
from knitjax.train.batch import make_batch, pack_rows, split_micro_batches
from knitjax.train.step import (
  StepHParams,
  batch_shardings,
  compile_train_step,
  host_metrics,
  init_train_state,
)

CFG = TransformerConfig(
  vocab_size=32, num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=64
)
P_LEN, N_NEW, ROWS = 4, 6, 8

MODES = {
  # GSPO with dual-clip and a clamped k1 KL term against a reference policy.
  "gspo_dual_k1": dict(
    ratio_level="sequence", aggregation="seq_mean_token_mean", eps_c=1.5, kl_coef=0.05,
    kl_estimator="k1", kl_clamp=0.5,
  ),
  # CISPO with GSPO-token ratios and the unscaled per-row-sum aggregation, k2 KL.
  "cispo_gspo_token": dict(
    objective="cispo", ratio_level="sequence_token", aggregation="seq_mean_token_sum_unscaled",
    kl_coef=0.05, kl_estimator="k2",
  ),
}  # fmt: skip


def _minibatch(seed=0):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(3, 32, rng.integers(2, P_LEN + 1)).astype(np.int32) for _ in range(ROWS)]
  lens = rng.integers(1, N_NEW + 1, ROWS)
  responses = [rng.integers(3, 32, n).astype(np.int32) for n in lens]
  logps = [rng.normal(-3.0, 0.5, n).astype(np.float32) for n in lens]
  adv = rng.normal(size=ROWS).astype(np.float32)
  return make_batch(
    pack_rows(prompts, responses, logps), adv, prompt_len=P_LEN, max_new_tokens=N_NEW, pad_id=0
  )


def _run(mesh, batch, micro_batches, loss_config):
  graphdef, params = sharding.init_sharded(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), mesh)
  tx = optax.sgd(1.0)
  state, shardings = init_train_state(params, tx, mesh)
  hp = StepHParams(loss=loss_config, max_new_tokens=N_NEW)
  step = compile_train_step(
    graphdef=graphdef, optimizer=tx, hparams=hp, state_shardings=shardings, mesh=mesh,
    with_ref=True,
  )  # fmt: skip
  before = jax.device_get(params)
  ref = jax.tree.map(lambda x: x * 0.9, params)
  dev_batch = jax.device_put(split_micro_batches(batch, micro_batches), batch_shardings(mesh))
  with jax.set_mesh(mesh):
    state, metrics = step(state, dev_batch, ref)
  grads = jax.tree.map(lambda a, b: a - b, before, jax.device_get(state.params))  # sgd(1.0)
  return grads, host_metrics(metrics)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_micro_batch_split_is_exact_in_every_mode(mode):
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  batch = _minibatch()
  loss_config = losses.LossConfig(entropy_coef=0.01, **MODES[mode])
  g1, m1 = _run(mesh, batch, 1, loss_config)
  g4, m4 = _run(mesh, batch, 4, loss_config)
  np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-5, atol=1e-7)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4), strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
  assert m1["grad_norm"] > 0 and m1["kl"] != 0
  for key in ("clip_frac", "dual_clip_frac", "ratio_mean", "kl"):
    np.testing.assert_allclose(m4[key], m1[key], rtol=1e-5, atol=1e-6)
