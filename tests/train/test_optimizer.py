"""The optimizer reads plain hyperparameters: warmup, clipping, AdamW."""

import types

import jax.numpy as jnp
import numpy as np
import optax

from knitjax.config_train import OptimizerConfig
from knitjax.train.optimizer import make_optimizer


def _hparams(**kw):
  base = dict(lr=0.1, warmup_steps=0, weight_decay=0.0, b1=0.9, b2=0.99, grad_clip=0.0)
  return types.SimpleNamespace(**{**base, **kw})


def _updates(hparams, grads):
  """The updates of successive steps from zero params."""
  tx = make_optimizer(hparams)
  params = {"w": jnp.zeros(2)}
  state, out = tx.init(params), []
  for grad in grads:
    updates, state = tx.update({"w": jnp.asarray(grad, jnp.float32)}, state, params)
    out.append(np.asarray(updates["w"]))
  return out


def _first_update(hparams, grad):
  return _updates(hparams, [grad])[0]


def test_matches_adamw_without_warmup_or_clipping():
  grad = np.array([3.0, -4.0])
  want_tx = optax.adamw(0.1, b1=0.9, b2=0.99, weight_decay=0.0)
  params = {"w": jnp.zeros(2)}
  want, _ = want_tx.update({"w": jnp.asarray(grad)}, want_tx.init(params), params)
  np.testing.assert_allclose(_first_update(_hparams(), grad), want["w"], rtol=1e-6)


def test_warmup_starts_at_zero_learning_rate():
  np.testing.assert_array_equal(_first_update(_hparams(warmup_steps=5), [3.0, -4.0]), [0.0, 0.0])


def test_clipping_scales_the_gradient_before_adam():
  # Adam's first step is lr * sign(g) whatever the scale, so the second step tells: a big first
  # gradient clipped to norm 1 must leave the same moments as that gradient at norm 1.
  big, unit = [30.0, -40.0], [0.6, -0.8]
  clipped = _updates(_hparams(grad_clip=1.0), [big, unit])
  reference = _updates(_hparams(), [unit, unit])
  np.testing.assert_allclose(clipped[1], reference[1], rtol=1e-5)
  unclipped = _updates(_hparams(), [big, unit])
  assert not np.allclose(unclipped[1], reference[1], rtol=1e-3)


def test_train_config_is_accepted():
  tx = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0))
  assert isinstance(tx, optax.GradientTransformation)
