"""Chunked log-probs and entropies (knitjax.train.logprobs) against the whole-logits path."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from knitjax import sharding
from knitjax.config_train import LayoutConfig
from knitjax.train import losses
from knitjax.train.logprobs import token_logprobs_and_entropy
from knitjax.train.step import StepHParams
from tests import tiny
from tests.tiny import N_NEW, TINY, random_minibatch

B, T, D, V = 2, 7, 16, 40
# float32 on the CPU; log-probs, entropies and gradients are of order 1 here. A chunk's matmul
# and sums over V may round differently from the whole logits' (entropies lse - E_p[z] cancel
# to ~1e-5); both paths are within 1.2e-5 of a float64 evaluation of the whole-logits formulas.
RTOL, ATOL, G_ATOL = 1e-5, 1e-5, 3e-5


def _inputs(table_axes, seed=0):
  k = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(k[0], (B, T, D), jnp.float32)
  shape = (V, D) if table_axes == "vd" else (D, V)
  table = jax.random.normal(k[1], shape, jnp.float32) * 0.5
  targets = jax.random.randint(k[2], (B, T), 0, V)
  w_logp = jax.random.normal(k[3], (B, T))
  w_ent = jax.random.normal(k[4], (B, T))
  return x, table, targets, w_logp, w_ent


def _reference(x, table, targets, table_axes, temperature):
  """The pre-existing path: whole float32 logits, then losses.token_logprobs / token_entropy."""
  spec = "btd,vd->btv" if table_axes == "vd" else "btd,dv->btv"
  z = jnp.einsum(spec, x, table, preferred_element_type=jnp.float32) / temperature
  return losses.token_logprobs(z, targets), losses.token_entropy(z)


@pytest.mark.parametrize("table_axes", ["vd", "dv"])
@pytest.mark.parametrize("chunk,temperature", [(3, 0.7), (7, 1.0), (64, 1.3), (1, 1.0)])
def test_values_and_gradients_match_whole_logits(table_axes, chunk, temperature):
  """Log-probs, entropies and their gradients w.r.t. hidden states and table; chunk sizes that
  divide T (7, 1), do not (3) and exceed it (64)."""
  x, table, targets, w_logp, w_ent = _inputs(table_axes)

  def loss(fn):
    def f(x, table):
      logp, ent = fn(x, table)
      return jnp.sum(w_logp * logp) + jnp.sum(w_ent * ent), (logp, ent)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, table)

  (_, (logp0, ent0)), (gx0, gw0) = loss(
    lambda x, w: _reference(x, w, targets, table_axes, temperature)
  )
  kw = dict(table_axes=table_axes, temperature=temperature, chunk=chunk, entropy="loss")
  (_, (logp1, ent1)), (gx1, gw1) = loss(
    lambda x, w: token_logprobs_and_entropy(x, w, targets, **kw)
  )
  np.testing.assert_allclose(logp1, logp0, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(ent1, ent0, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(gx1, gx0, rtol=RTOL, atol=G_ATOL)
  np.testing.assert_allclose(gw1, gw0, rtol=RTOL, atol=G_ATOL)


@pytest.mark.parametrize("entropy", ["none", "metric"])
def test_entropy_off_or_metric_gives_log_prob_gradients_only(entropy):
  """Without the entropy term the gradient is that of the log-probs alone; the metric's value is
  still exact."""
  table_axes, temperature = "vd", 0.8
  x, table, targets, w_logp, w_ent = _inputs(table_axes, seed=1)

  def f_ref(x, table):
    return jnp.sum(w_logp * _reference(x, table, targets, table_axes, temperature)[0])

  def f(x, table):
    logp, ent = token_logprobs_and_entropy(
      x, table, targets, table_axes=table_axes, temperature=temperature, chunk=3, entropy=entropy
    )
    extra = 0.0 if ent is None else jnp.sum(w_ent * ent)  # no gradient in "metric"
    return jnp.sum(w_logp * logp) + extra, ent

  g0 = jax.jit(jax.grad(f_ref, argnums=(0, 1)))(x, table)
  g1, ent = jax.jit(jax.grad(f, argnums=(0, 1), has_aux=True))(x, table)
  for a, b in zip(g1, g0, strict=True):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=G_ATOL)
  if entropy == "none":
    assert ent is None
  else:
    np.testing.assert_allclose(
      ent, _reference(x, table, targets, table_axes, temperature)[1], rtol=RTOL, atol=ATOL
    )


def test_bfloat16_hidden_states_keep_their_dtype_and_match():
  """Compute-dtype inputs: the gradients come back in bfloat16, close to whole-logits ones."""
  x, table, targets, w_logp, _ = _inputs("vd", seed=2)
  x, table = x.astype(jnp.bfloat16), table.astype(jnp.bfloat16)

  def f(fn):
    return jax.jit(jax.grad(lambda x, w: jnp.sum(w_logp * fn(x, w)), argnums=(0, 1)))(x, table)

  g0 = f(lambda x, w: _reference(x, w, targets, "vd", 1.0)[0])
  g1 = f(
    lambda x, w: token_logprobs_and_entropy(
      x, w, targets, table_axes="vd", chunk=3, entropy="none"
    )[0]
  )
  for a, b in zip(g1, g0, strict=True):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tie", [True, False])
def test_model_hidden_states_and_unembedding_give_its_logits(tie):
  cfg = dataclasses.replace(TINY, tie_embeddings=tie, value_head=True)
  model = nnx.merge(*tiny.init(cfg))  # a jitted init; the calls below run eagerly
  tokens = jax.random.randint(jax.random.key(0), (B, T), 0, cfg.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  valid = jnp.ones((B, T), bool)
  table, table_axes = model.unembedding()
  assert table_axes == ("vd" if tie else "dv")
  hidden, values = model.hidden_states_and_values(tokens, positions, valid)
  logits0, values0 = model.logits_and_values(tokens, positions, valid)
  spec = "btd,vd->btv" if tie else "btd,dv->btv"
  logits = jnp.einsum(spec, hidden, table, preferred_element_type=jnp.float32)
  np.testing.assert_allclose(logits, logits0, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(values, values0, rtol=1e-6, atol=1e-6)


def _step(mesh, batch, model_cfg, hp):
  kl = hp.loss.kl_coef > 0
  return tiny.train_step(
    mesh, batch, hp, micro_batches=2, config=model_cfg, ref_scale=0.9 if kl else None
  )


@pytest.mark.parametrize(
  "tie,entropy_coef,kl_coef,temperature",
  [
    (True, 0.01, 0.04, 0.7),
    (False, 0.0, 0.0, 1.0),  # untied: 2 more compiles
  ],
)
def test_train_step_params_match_whole_logits(tie, entropy_coef, kl_coef, temperature):
  """One SGD(1.0) step, 2 micro-batches: the update (the gradient) and every metric of the
  chunked step (3 positions per chunk: T = 11 is not a multiple) equal the whole-logits step's
  within float32 tolerances; tied head with entropy and KL terms, and untied without."""
  mesh = tiny.one_device_mesh()
  cfg = dataclasses.replace(TINY, tie_embeddings=tie)
  loss = losses.LossConfig(eps_high=0.28, kl_coef=kl_coef, entropy_coef=entropy_coef)
  hp = StepHParams(loss=loss, max_new_tokens=N_NEW, temperature=temperature, logprob_chunk=0)
  batch = random_minibatch()
  before, p0, m0 = _step(mesh, batch, cfg, hp)
  _, p1, m1 = _step(mesh, batch, cfg, dataclasses.replace(hp, logprob_chunk=3))
  for k in m0:
    np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)
  g0, g1 = tiny.gradient(before, p0), tiny.gradient(before, p1)
  tiny.assert_trees_close(g1, g0, rtol=1e-4, atol=1e-6)


def test_sharded_chunked_step_matches_whole_logits():
  """(2, 2, 2) mesh on 8 fake devices (rows on the batch axes, the vocab on "tensor"): the
  chunked step's update equals the whole-logits step's on the same mesh."""
  mesh = sharding.make_mesh((2, 2, 2))
  cfg = TINY
  loss = losses.LossConfig(kl_coef=0.04, entropy_coef=0.01)
  hp = StepHParams(loss=loss, max_new_tokens=N_NEW, temperature=0.7, logprob_chunk=0)
  batch = random_minibatch(seed=4, rows=16)
  before, p0, m0 = _step(mesh, batch, cfg, hp)
  _, p1, m1 = _step(mesh, batch, cfg, dataclasses.replace(hp, logprob_chunk=4))
  np.testing.assert_allclose(m1["loss"], m0["loss"], rtol=1e-5, atol=1e-6)
  g0, g1 = tiny.gradient(before, p0), tiny.gradient(before, p1)
  tiny.assert_trees_close(g1, g0, rtol=1e-4, atol=1e-6)


def test_config_refuses_a_negative_chunk():
  with pytest.raises(ValueError, match=r"config\.layout\.logprob_chunk=-1 is not accepted"):
    LayoutConfig(logprob_chunk=-1)
  assert LayoutConfig().logprob_chunk > 0  # on by default


def test_a_frozen_table_gets_no_gradient_work():
  """With the table not differentiated (a frozen LoRA base) its gradient is skipped in the
  backward; the hidden states' gradient is unchanged."""
  x, table, targets, w_logp, _ = _inputs("dv", seed=3)

  def f(fn):
    return jax.jit(jax.grad(lambda x: jnp.sum(w_logp * fn(x))))(x)

  g0 = f(lambda x: _reference(x, table, targets, "dv", 1.0)[0])
  g1 = f(lambda x: token_logprobs_and_entropy(x, table, targets, table_axes="dv", chunk=4)[0])
  np.testing.assert_allclose(g1, g0, rtol=RTOL, atol=G_ATOL)


@pytest.mark.parametrize("temperature", [1.2e-38, float(np.finfo(np.float32).tiny), 1e-6])
@pytest.mark.parametrize("chunk", [0, 3])
def test_the_smallest_temperatures_give_finite_logprobs_and_gradients(chunk, temperature):
  """Issue 47: at T = 1.2e-38 (the config accepts T >= 1.18e-38) logits / T overflowed to inf,
  the log-sum-exp gave NaN and the run died blaming the data. The sampled token (the argmax at
  such a temperature) has log-prob 0 there, as the sampler reports."""
  x, table, _, w_logp, w_ent = _inputs("vd")
  targets = jnp.argmax(jnp.einsum("btd,vd->btv", x, table), axis=-1)
  kw = dict(table_axes="vd", temperature=temperature, chunk=chunk, entropy="loss")

  def loss(x, w):
    logp, ent = token_logprobs_and_entropy(x, w, targets, **kw)
    return jnp.sum(w_logp * logp) + jnp.sum(w_ent * ent), (logp, ent)

  (_, (logp, ent)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, table)
  np.testing.assert_allclose(logp, 0.0, atol=1e-5)
  np.testing.assert_allclose(ent, 0.0, atol=1e-5)
  assert all(np.isfinite(g).all() for g in grads)
  logits_btv = jnp.einsum("btd,vd->btv", x, table)
  plain = losses.token_logprobs(logits_btv, targets, temperature=temperature)
  np.testing.assert_allclose(plain, 0.0, atol=1e-5)
