"""The tiny decoder the tests share, its random mini-batches, and one train step on it.

Every test that needs "some tiny decoder" builds this one shape, so that the programs the tests
compile (its init, forward, sampler and train steps) coincide across modules and the run's
persistent compilation cache (tests/conftest.py) compiles each once. A test about a shape (GQA
head ratios, RoPE scaling, a task's vocab, the sharded layouts) keeps its own.
"""

import dataclasses
import functools

import jax
import numpy as np
import optax
from flax import nnx

from knitjax import sharding
from knitjax.models import lora
from knitjax.models.transformer import Transformer, TransformerConfig
from knitjax.models.vision import VisionConfig
from knitjax.train import prefix
from knitjax.train.batch import make_batch, pad_rows
from knitjax.train.step import batch_shardings, compile_train_step, host_metrics, init_train_state

TINY = TransformerConfig(
  vocab_size=32, num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=64
)
# The vision tower of the tiny VLM (knitjax.models.vlm.VLM(TINY, TINY_VISION, ...)): 8 x 8
# images of 4 x 4 patches.
TINY_VISION = VisionConfig(
  image_size=8,
  patch_size=4,
  d_model=32,
  num_layers=1,
  num_heads=4,
  head_dim=8,
  mlp_dim=64,
  projector_dim=64,
)
# Prompt and response lengths and rows of a random mini-batch.
P_LEN, N_NEW, ROWS = 4, 6, 8


def one_device_mesh() -> jax.sharding.Mesh:
  return sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])


@functools.cache
def _init(config, mesh):
  return sharding.init_sharded(lambda: Transformer(config, rngs=nnx.Rngs(0)), mesh)


def init(config=TINY, mesh=None):
  """(graphdef, params) of ``config`` from seed 0, sharded on ``mesh`` (one device by default):
  fresh buffers, which the caller may edit or donate, of one init per config and mesh."""
  graphdef, params = _init(config, mesh or one_device_mesh())
  return graphdef, jax.tree.map(lambda x: x.copy(), params)


def random_rows(rng, rows=ROWS, *, p_len=P_LEN, n_new=N_NEW, min_prompt=2, min_response=1):
  """``pad_rows`` of random prompts (``min_prompt..p_len`` tokens), responses
  (``min_response..n_new``) and behaviour log-probs off the policy, so that ratios differ from 1
  and clipping is active. Tokens are 3..31: ids of TINY's vocab that are not padding."""
  prompts = [
    rng.integers(3, 32, rng.integers(min_prompt, p_len + 1)).astype(np.int32) for _ in range(rows)
  ]
  lens = rng.integers(min_response, n_new + 1, rows)
  responses = [rng.integers(3, 32, n).astype(np.int32) for n in lens]
  logps = [rng.normal(-3.0, 0.5, n).astype(np.float32) for n in lens]
  return pad_rows(prompts, responses, logps)


def random_minibatch(seed=0, rows=ROWS):
  """A padded mini-batch of ``random_rows`` with random per-row advantages."""
  rng = np.random.default_rng(seed)
  packed = random_rows(rng, rows)
  adv = rng.normal(size=rows).astype(np.float32)
  return make_batch(packed, adv, prompt_len=P_LEN, max_new_tokens=N_NEW, pad_id=0)


def lora_model(mesh, rank=4, alpha=8.0):
  """TINY with LoRA adapters of ``rank`` on ``mesh``: ``(graphdef, adapters, base)``, the
  adapters shifted by 0.05 so that B != 0 (they change the model, as trained ones do)."""
  config = dataclasses.replace(TINY, lora_rank=rank, lora_alpha=alpha)
  graphdef, params = sharding.init_sharded(lambda: Transformer(config, rngs=nnx.Rngs(0)), mesh)
  adapters, base = lora.split(params)
  return graphdef, jax.tree.map(lambda x: x + 0.05, adapters), base


def groups_batch(seed=0, groups=3, g=4, *, p_len=6, n_new=5, fallback=True):
  """A padded mini-batch of ``groups`` GRPO groups of ``g`` responses to one random prompt each
  (what the shared-prompt layouts share); with ``fallback`` the last group's rows hold different
  prompts (each row its own). Row 1 holds a tool-output token: attended to, no loss."""
  from knitjax.train import advantages

  rng = np.random.default_rng(seed)
  prompts, responses, logps = [], [], []
  for i in range(groups):
    prompt = rng.integers(3, 32, rng.integers(2, p_len + 1)).astype(np.int32)
    for _ in range(g):
      if fallback and i == groups - 1:
        prompt = rng.integers(3, 32, rng.integers(2, p_len + 1)).astype(np.int32)
      n = rng.integers(1, n_new + 1)
      prompts.append(prompt)
      responses.append(rng.integers(3, 32, n).astype(np.int32))
      logps.append(rng.normal(-3.0, 0.5, n).astype(np.float32))
  rows = groups * g
  rewards = rng.integers(0, 2, rows).astype(np.float32)
  adv = advantages.compute_advantages(rewards.reshape(-1, g), "grpo").reshape(-1)
  batch = make_batch(
    pad_rows(prompts, responses, logps), adv, prompt_len=p_len, max_new_tokens=n_new, pad_id=0,
    rewards=rewards, group_ids=np.repeat(np.arange(groups) * 7 + 3, g),
  )  # fmt: skip
  batch["loss_mask"][1, p_len] = 0.0
  batch["behavior_logp"][1, p_len] = 0.0
  return batch


def loss_inputs(seed, b=8, t=6, *, ref_noise=0.3):
  """Per-token inputs of a policy loss, ``[b, t]``: log-probs near the behaviour's, a reference
  ``ref_noise`` away, random entropies, and one row (3) with no response tokens."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, t + 1, size=b)
  lengths[3] = 0  # a row with no response tokens (padding)
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
  behavior = -rng.uniform(0.1, 3.0, size=(b, t)).astype(np.float32)
  logp = behavior + rng.normal(0, 0.5, size=(b, t)).astype(np.float32)
  return dict(
    logp=logp,
    behavior=behavior,
    adv=rng.normal(size=b).astype(np.float32),
    mask=mask,
    ref=behavior + rng.normal(0, ref_noise, size=(b, t)).astype(np.float32),
    ent=rng.uniform(0, 2, size=(b, t)).astype(np.float32),
  )


def train_step(
  mesh,
  batch,
  hparams,
  *,
  micro_batches=None,
  config=TINY,
  tx=None,
  ref_scale=None,
  packed=False,
  shared=False,
  prefixed=False,
  edit_params=None,
):
  """One compiled train step of ``config`` from its seed-0 init: (params before, params after,
  host metrics).

  ``micro_batches``: split the ``[rows, ...]`` batch into that many (None: it is split already).
  ``tx``: SGD(1.0) by default, so that ``before - after`` is the gradient (``gradient``).
  ``ref_scale``: a reference policy of the params times it (the step's ``with_ref``).
  ``edit_params``: called on the fresh params before the step's state is made from them.
  """
  graphdef, params = init(config, mesh)
  if edit_params is not None:
    edit_params(params)
  tx = tx or optax.sgd(1.0)
  state, shardings = init_train_state(params, tx, mesh)
  step = compile_train_step(
    graphdef=graphdef,
    optimizer=tx,
    hparams=hparams,
    state_shardings=shardings,
    mesh=mesh,
    with_ref=ref_scale is not None,
    packed=packed,
    shared=shared,
    prefixed=prefixed,
  )
  before = jax.device_get(params)
  extra = () if ref_scale is None else (jax.tree.map(lambda x: x * ref_scale, params),)
  if micro_batches is not None:
    batch = prefix.split_micro_batches(batch, micro_batches)
  layout = dict(packed=packed, shared=shared, prefixed=prefixed)
  batch = jax.device_put(dict(batch), batch_shardings(mesh, **layout))
  with jax.set_mesh(mesh):
    state, metrics = step(state, batch, *extra)
  return before, jax.device_get(state.params), host_metrics(metrics)


def lora_step(mesh, graphdef, adapters, base, batch, hparams, *, micro_batches=2, **layout):
  """One compiled LoRA step (SGD(1.0)) of ``adapters`` over the frozen ``base`` on ``batch``
  (``layout``: the step's ``packed`` / ``shared``): (adapters after, host metrics)."""
  tx = optax.sgd(1.0)
  state, shardings = init_train_state(jax.tree.map(lambda x: x.copy(), adapters), tx, mesh)
  step = compile_train_step(
    graphdef=graphdef, optimizer=tx, hparams=hparams, state_shardings=shardings, mesh=mesh,
    frozen_shardings=sharding.state_shardings(base, mesh), **layout,
  )  # fmt: skip
  dev = jax.device_put(
    prefix.split_micro_batches(batch, micro_batches), batch_shardings(mesh, **layout)
  )
  with jax.set_mesh(mesh):
    state, metrics = step(state, dev, base)
  return jax.device_get(state.params), host_metrics(metrics)


def gradient(before, after):
  """The gradient an SGD(1.0) update took: ``before - after``, leaf by leaf."""
  return jax.tree.map(lambda a, b: a - b, before, after)


def assert_trees_close(actual, desired, *, rtol, atol):
  for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired), strict=True):
    np.testing.assert_allclose(a, d, rtol=rtol, atol=atol)


def vlm_grads(mesh, graphdef, params, hp, batch, micro_batches, *, ref=None, **layout):
  """``(loss, metric sums, gradient, encoder counts)`` of `mm_step.mm_value_and_grad` on a host
  ``batch`` split into ``micro_batches``, jitted on ``mesh`` (``layout``: `batch_shardings`'
  flags)."""
  from knitjax.train import mm_step

  fn = jax.jit(functools.partial(mm_step.mm_value_and_grad, graphdef=graphdef, hparams=hp))
  host = mm_step.prepare_batch(batch, micro_batches)
  dev = jax.device_put(host, mm_step.batch_shardings(mesh, **layout))
  with jax.set_mesh(mesh):
    return jax.device_get(fn(params, dev, ref_params=ref))


def assert_vlm_grads_equal(actual, desired):
  """Loss and metric sums (rtol 1e-5) and every gradient entry (rtol 1e-4, atol 1e-6) of two
  `vlm_grads` results equal."""
  (l1, s1, g1, _), (l0, s0, g0, _) = actual, desired
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  for key in s0:
    np.testing.assert_allclose(s1[key], s0[key], rtol=1e-5, atol=1e-6, err_msg=key)
  assert_trees_close(g1, g0, rtol=1e-4, atol=1e-6)


def set_fields(c, **fields) -> None:
  """Sets each field in the one run or training section that has it (``loop``, ``topology``,
  ``sync``, ``pipeline``, ``optimizer``, ``loss``, ``critic``, ``layout``, ``vlm``), so a test
  can name the fields it changes without their sections: ``set_fields(c, steps=2, packing="pack")``.
  """
  import dataclasses

  from knitjax.config_run import RUN_SECTIONS
  from knitjax.config_train import TRAIN_SECTIONS

  home = {
    f.name: name
    for name, cls in {**RUN_SECTIONS, **TRAIN_SECTIONS}.items()
    for f in dataclasses.fields(cls)
  }
  for key, value in fields.items():
    if key not in home:
      raise KeyError(f"{key} is a field of none of the run and training sections.")
    c[home[key]][key] = value
