"""The KL reference policy stored in bfloat16 (config.loss.reference_dtype)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from knitjax import config_train as config_lib
from knitjax.runtime.builder import reference_params
from knitjax.train import losses
from knitjax.train.batch import split_micro_batches
from knitjax.train.step import StepHParams, batch_shardings, compile_train_step, init_train_state
from tests import tiny
from tests.tiny import N_NEW, TINY, random_minibatch


def _params(mesh):
  return tiny.init(TINY, mesh)


def test_reference_params_are_new_buffers_in_the_chosen_dtype():
  mesh = tiny.one_device_mesh()
  _, params = _params(mesh)
  for dtype in ("float32", "bfloat16"):
    ref = reference_params(params, dtype)
    for p, r in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True):
      assert r.dtype == jnp.dtype(dtype)
      np.testing.assert_array_equal(np.asarray(r), np.asarray(p.astype(dtype)))
      # Never an alias: the train step donates the params it is given.
      assert r.unsafe_buffer_pointer() != p.unsafe_buffer_pointer()


def test_a_bfloat16_reference_gives_nearly_the_float32_kl():
  mesh = tiny.one_device_mesh()
  batch = split_micro_batches(random_minibatch(), 2)
  kls = {}
  for dtype in ("float32", "bfloat16"):
    graphdef, params = _params(mesh)
    tx = optax.sgd(0.0)
    state, shardings = init_train_state(params, tx, mesh)
    hp = StepHParams(loss=losses.LossConfig(kl_coef=0.1), max_new_tokens=N_NEW)
    step = compile_train_step(
      graphdef=graphdef,
      optimizer=tx,
      hparams=hp,
      state_shardings=shardings,
      mesh=mesh,
      with_ref=True,
    )
    # A reference away from the policy, so the KL is not 0.
    ref = reference_params(jax.tree.map(lambda x: x * 0.9, params), dtype)
    with jax.set_mesh(mesh):
      _, metrics = step(state, jax.device_put(batch, batch_shardings(mesh)), ref)
    kls[dtype] = float(jax.device_get(metrics["kl_sum"]))
  assert kls["float32"] > 0
  # bf16 rounds each weight to 8 bits of mantissa: the KL moves by under 2%.
  np.testing.assert_allclose(kls["bfloat16"], kls["float32"], rtol=2e-2)


def test_an_unknown_reference_dtype_is_refused():
  with pytest.raises(ValueError, match="config.loss.reference_dtype"):
    config_lib.LossConfig(reference_dtype="float16")
