"""The loss menu through the real train step: the micro-batch split stays exact in every mode.

GSPO's sequence ratio needs each row's whole response in one micro-batch; the step's micro-batch
split keeps rows whole, so the mini-batch's loss and gradient do not depend on the split.
"""

import numpy as np
import pytest

from knitjax.train import losses
from knitjax.train.step import StepHParams
from tests import tiny
from tests.tiny import N_NEW, random_minibatch

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


def _run(mesh, batch, micro_batches, loss_config):
  hp = StepHParams(loss=loss_config, max_new_tokens=N_NEW)
  before, after, metrics = tiny.train_step(
    mesh, batch, hp, micro_batches=micro_batches, ref_scale=0.9
  )
  return tiny.gradient(before, after), metrics


@pytest.mark.parametrize("mode", sorted(MODES))
def test_micro_batch_split_is_exact_in_every_mode(mode):
  mesh = tiny.one_device_mesh()
  batch = random_minibatch()
  loss_config = losses.LossConfig(entropy_coef=0.01, **MODES[mode])
  g1, m1 = _run(mesh, batch, 1, loss_config)
  g4, m4 = _run(mesh, batch, 4, loss_config)
  np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-5, atol=1e-7)
  tiny.assert_trees_close(g4, g1, rtol=1e-4, atol=1e-6)
  assert m1["grad_norm"] > 0 and m1["kl"] != 0
  for key in ("clip_frac", "dual_clip_frac", "ratio_mean", "kl"):
    np.testing.assert_allclose(m4[key], m1[key], rtol=1e-5, atol=1e-6)
