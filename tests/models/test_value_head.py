"""The critic head on the policy's trunk: the policy is unchanged, and it is checkpointed."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from knitjax.models import hf
from knitjax.models.transformer import Transformer
from knitjax.train.checkpoint import Checkpointer
from tests.tiny import TINY

CFG = TINY  # tests/tiny.py


def _inputs():
  tokens = jnp.array([[0, 5, 7, 9, 3], [4, 4, 8, 1, 2]], jnp.int32)
  valid = jnp.array([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], bool)
  positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
  return tokens, positions, valid


def test_the_value_head_leaves_the_policy_unchanged_and_starts_at_zero():
  plain = Transformer(CFG, rngs=nnx.Rngs(0))
  critic = Transformer(dataclasses.replace(CFG, value_head=True), rngs=nnx.Rngs(0))
  logits = nnx.jit(lambda m, *x: m(*x))(plain, *_inputs())
  both_logits, values = nnx.jit(lambda m, *x: m.logits_and_values(*x))(critic, *_inputs())
  # Same init (the head comes last), so the same policy.
  np.testing.assert_array_equal(nnx.jit(lambda m, *x: m(*x))(critic, *_inputs()), logits)
  np.testing.assert_allclose(both_logits, logits, rtol=1e-6)
  assert values.shape == (2, 5) and values.dtype == jnp.float32
  np.testing.assert_array_equal(values, 0.0)
  with pytest.raises(ValueError, match="needs a value head"):
    plain.logits_and_values(*_inputs())


def test_the_value_head_round_trips_through_a_checkpoint(tmp_path):
  model = Transformer(dataclasses.replace(CFG, value_head=True), rngs=nnx.Rngs(0))
  _, params = nnx.split(model)
  params["value_head"]["kernel"][...] = jnp.arange(float(CFG.d_model)) / CFG.d_model
  params["value_head"]["bias"][...] = jnp.float32(0.25)
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(3, {"params": params}, {"version": 3})
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path))
  zeros = jax.tree.map(jnp.zeros_like, params)
  restored, meta = ckpt.restore({"params": zeros})
  ckpt.close()
  assert meta["version"] == 3
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored["params"]), strict=True):
    np.testing.assert_array_equal(b, a)
  np.testing.assert_allclose(restored["params"]["value_head"]["bias"], 0.25)


def test_a_hugging_face_export_leaves_the_critic_out():
  plain = nnx.state(Transformer(CFG, rngs=nnx.Rngs(0)))
  critic = nnx.state(Transformer(dataclasses.replace(CFG, value_head=True), rngs=nnx.Rngs(0)))
  names = lambda state: [item[0] for item in hf.save_items(state, np.dtype(np.float32))]  # noqa: E731
  assert names(critic) == names(plain)
