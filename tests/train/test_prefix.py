"""Prompts once per mini-batch (`knitjax.train.prefix`): the layout's invariants, and loss, metrics
and every gradient entry equal to the padded layout's (float32: rtol 1e-5 on loss and metrics,
rtol 1e-4 / atol 1e-6 per gradient entry) when a group's rows span 2 and 4 micro-batches, with
LoRA, on 2 devices and for a VLM; and the check fails when the prompts' cotangent is not
accumulated."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from knitjax import sharding
from knitjax.models.transformer import Transformer
from knitjax.train import accumulation, losses, prefix
from knitjax.train.batch import make_batch, pad_rows
from knitjax.train.step import StepHParams
from knitjax.train.step_advantages import AdvantageConfig
from tests import tiny
from tests.tiny import TINY

P, N, G, GROUPS = 6, 5, 4, 4
SLOTS = GROUPS + G  # the fallback group's rows hold a prompt each


def _batch(seed=0):
  """``GROUPS`` groups of ``G`` rows, the last with a different prompt per row (each its own
  prompt), laid out round-robin: micro-batch ``k`` of K holds rows ``k R / K ..``, so with 16
  rows every group has a row in each of 4 micro-batches (2 rows in each of 2)."""
  batch = tiny.groups_batch(seed, GROUPS, G, p_len=P, n_new=N)
  rows = GROUPS * G
  order = np.arange(rows).reshape(GROUPS, G).T.reshape(-1)  # round-robin over the groups
  return {k: v[order] for k, v in batch.items()}


def _spans(index, k):
  """Micro-batches each prompt's rows fall in."""
  per = index.reshape(k, -1)
  return {u: int((per == u).any(axis=1).sum()) for u in np.unique(index)}


def test_hand_example_layout():
  prompts = [np.array([5, 6, 7])] * 2 + [np.array([9])]
  responses = [np.array([8, 9]), np.array([10]), np.array([11])]
  batch = make_batch(
    pad_rows(prompts, responses, [np.array([-1.0, -2.0]), np.array([-3.0]), np.array([-4.0])]),
    np.array([0.5, -0.5, 1.0]), prompt_len=4, max_new_tokens=2, pad_id=0,
    group_ids=np.array([1, 1, 2]),
  )  # fmt: skip
  out = prefix.prefix_batch(batch, prompt_len=4, slots=3)
  # The prompts' first P - 1 columns once, left-padded as in their rows; slot 2 unused.
  np.testing.assert_array_equal(out["prefix_tokens"], [[0, 5, 6], [0, 0, 0], [0, 0, 0]])
  np.testing.assert_array_equal(out["prefix_valid"], [[0, 1, 1], [0, 0, 0], [0, 0, 0]])
  np.testing.assert_array_equal(out["prefix_positions"][0], [0, 0, 1])
  np.testing.assert_array_equal(out["prefix_index"], [0, 0, 1])
  # Rows: the prompt's last token, then the response but its last column (a full response's
  # last token, 9, is a target only), scored where the padded row scores them.
  np.testing.assert_array_equal(out["tokens"], [[7, 8], [7, 10], [9, 11]])
  np.testing.assert_array_equal(out["positions"], [[2, 3], [2, 3], [0, 1]])
  np.testing.assert_array_equal(out["targets"], [[8, 9], [10, 0], [11, 0]])
  np.testing.assert_array_equal(out["loss_mask"], [[1, 1], [1, 0], [1, 0]])
  np.testing.assert_array_equal(out["advantages"], [0.5, -0.5, 1.0])
  with pytest.raises(ValueError, match="2 distinct prompts, more than the layout's 1"):
    prefix.prefix_batch(batch, prompt_len=4, slots=1)


def test_planned_metrics_are_the_laid_out_ones():
  batch = _batch(seed=1)
  keep = batch["group_id"] != batch["group_id"].max()  # the groups that share their prompt
  batch = {k: v[keep] for k, v in batch.items()}
  valid = batch["valid"]
  group = batch["group_id"]
  counts = [
    (tuple(valid[r, :P].sum() for r in rows), tuple(valid[r, P:].sum() for r in rows))
    for rows in (np.flatnonzero(group == g) for g in np.unique(group))
  ]
  spec = prefix.PrefixSpec(P, SLOTS)
  out, metrics = spec.with_metrics(batch)
  count, planned = spec.plan_parts([counts], row_len=P + N)
  assert count == len(group) and planned == pytest.approx(metrics)
  assert metrics["share_prompts"] == GROUPS - 1 and metrics["share_token_ratio"] > 1.2
  assert out["tokens"].shape == (len(group), N)


def _hparams(mode):
  if mode == "gae_kl_reward":  # a critic and the KL as a reward: in-step advantages
    return StepHParams(
      loss=losses.LossConfig(kl_coef=0.05, kl_penalty="reward"), max_new_tokens=N,
      advantage=AdvantageConfig(estimator="gae", gamma=0.95, gae_lambda=0.9),
    )  # fmt: skip
  return StepHParams(loss=losses.LossConfig(kl_coef=0.05, entropy_coef=0.01), max_new_tokens=N)


def _step(devices, batch, k, mode, *, prefixed):
  mesh = sharding.make_mesh((devices, 1, 1), devices=jax.devices()[:devices])
  hp = _hparams(mode)

  def critic_predicts(params):  # a critic that predicts something: GAE bootstraps real values
    params["value_head"]["bias"][...] = params["value_head"]["bias"][...] + 0.3

  before, after, metrics = tiny.train_step(
    mesh, batch, hp, micro_batches=k, ref_scale=0.9, prefixed=prefixed,
    config=dataclasses.replace(TINY, value_head=hp.advantage.critic),
    edit_params=critic_predicts if hp.advantage.critic else None,
  )  # fmt: skip
  return tiny.gradient(before, after), metrics


@functools.cache
def _padded(mode):
  """The padded layout's step, one micro-batch on one device: the reference of every case."""
  return _step(1, _batch(), 1, mode, prefixed=False)


def _assert_equal(g0, m0, g1, m1):
  assert m0["grad_norm"] > 0 and m0["kl"] != 0
  for key in sorted(m0):
    np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5, atol=1e-6, err_msg=key)
  tiny.assert_trees_close(g1, g0, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
  "k,devices,mode", [(2, 1, "grpo"), (4, 1, "grpo"), (4, 2, "grpo"), (2, 1, "gae_kl_reward")]
)
def test_step_equals_padded_step(k, devices, mode):
  """Each group's rows in K micro-batches (every one of them), its prompt run once: loss, metrics
  (KL, entropy, clip fractions) and the SGD update equal the padded layout's, also on 2 devices
  and with in-step advantages (a critic, the KL as a reward)."""
  layout = prefix.prefix_batch(_batch(), prompt_len=P, slots=SLOTS)
  spans = _spans(layout["prefix_index"], k)
  assert all(spans[u] == k for u in range(GROUPS - 1))  # every shared prompt in all K
  g1, m1 = _step(devices, layout, k, mode, prefixed=True)
  _assert_equal(*_padded(mode), g1, m1)


def test_lora_step_equals_padded_step():
  """LoRA (adapters trained, the base frozen and the reference): the same update."""
  mesh = tiny.one_device_mesh()
  graphdef, adapters, base = tiny.lora_model(mesh)  # B != 0: the adapters matter
  batch = _batch(seed=5)
  hp = StepHParams(loss=losses.LossConfig(kl_coef=0.05), max_new_tokens=N)
  p0, m0 = tiny.lora_step(mesh, graphdef, adapters, base, batch, hp, micro_batches=1)
  layout = prefix.prefix_batch(batch, prompt_len=P, slots=SLOTS)
  p1, m1 = tiny.lora_step(mesh, graphdef, adapters, base, layout, hp, micro_batches=4,
                          prefixed=True)  # fmt: skip
  assert m0["kl"] != 0
  for key in sorted(m0):
    np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5, atol=1e-6, err_msg=key)
  tiny.assert_trees_close(p1, p0, rtol=1e-4, atol=1e-6)


def test_the_prompts_cotangent_must_be_accumulated(monkeypatch):
  """The mutation the exactness tests catch: keeping only the last micro-batch's cotangent for
  the prompts (not their sum) changes the gradient; loss and metrics stay the same."""
  monkeypatch.setattr(accumulation, "accumulate", lambda total, ct: jax.tree.map(
    lambda a, b: b.astype(a.dtype), total, ct))  # fmt: skip
  layout = prefix.prefix_batch(_batch(), prompt_len=P, slots=SLOTS)
  g1, m1 = _step(1, layout, 2, "grpo", prefixed=True)
  g0, m0 = _padded("grpo")
  np.testing.assert_allclose(m1["loss"], m0["loss"], rtol=1e-5)
  with pytest.raises(AssertionError):
    tiny.assert_trees_close(g1, g0, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_rows_continue_their_prompts(scan_layers):
  """The model's states of a row over its prompt's keys and values (`SequenceMask.past_k`) are
  the padded row's at its columns ``[P - 1, P + N - 1)``, looped or scanned over the layers."""
  from knitjax.models.attention import SequenceMask  # noqa: PLC0415

  config = dataclasses.replace(TINY, num_layers=2, scan_layers=scan_layers)
  graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
  batch = _batch(seed=2)
  layout = prefix.prefix_batch(batch, prompt_len=P, slots=SLOTS)

  @jax.jit
  def both(params, batch, layout):
    model = nnx.merge(graphdef, params)
    padded = model.hidden_states(batch["tokens"], batch["positions"], batch["valid"])
    k, v = model.keys_values(
      layout["prefix_tokens"], layout["prefix_positions"], layout["prefix_valid"]
    )
    mb = prefix.attach(layout, {"k": k, "v": v}, layout)
    mask = SequenceMask(past_k=mb["past_k"], past_v=mb["past_v"], past_valid_bs=mb["past_valid"])
    return padded, model.hidden_states(
      layout["tokens"], layout["positions"], layout["valid"], mask=mask
    )

  padded, rows = both(params, batch, layout)
  valid = layout["valid"]
  np.testing.assert_allclose(
    np.asarray(rows)[valid], np.asarray(padded)[:, P - 1 : P + N - 1][valid], rtol=1e-5, atol=1e-5
  )


def test_a_config_chooses_the_layout():
  """``layout.prompt_sharing="prefix"`` (configs/arith_tiny.py:prefix) builds `SharedPrefix`
  with a prompt slot per group of a mini-batch; packing or a VLM is refused in one sentence."""
  from configs import arith_tiny  # noqa: PLC0415
  from knitjax.config import from_config_dict  # noqa: PLC0415
  from knitjax.runtime.layout_choice import build_layout  # noqa: PLC0415
  from knitjax.train import layouts  # noqa: PLC0415

  c = arith_tiny.get_config("prefix,quick")
  mesh = sharding.make_mesh((2, 1, 1), devices=jax.devices()[:2])
  layout = build_layout(from_config_dict(c), mesh, prompt_len=8)
  assert isinstance(layout, layouts.SharedPrefix) and layout.spec == prefix.PrefixSpec(8, 32)
  c.layout.packing = "pack"
  with pytest.raises(ValueError, match="prompt_sharing='prefix' takes padded rows"):
    from_config_dict(c)


def test_vlm_step_equals_padded_step():
  """A VLM (each unique image encoded once, the encoder trained): each image prompt run once,
  its group's rows shuffled over 4 micro-batches; loss, metric sums and the vision, projector
  and decoder gradients equal the padded layout's, one encoder forward and backward."""
  from knitjax.models.vlm import VLM  # noqa: PLC0415
  from tests.tiny import TINY_VISION  # noqa: PLC0415
  from tests.train.test_prompt_sharing import _vlm_batch  # noqa: PLC0415

  mesh = tiny.one_device_mesh()
  graphdef, params = sharding.init_sharded(
    lambda: VLM(TINY, TINY_VISION, image_token_id=3, rngs=nnx.Rngs(0)), mesh
  )
  ref = jax.tree.map(lambda x: 0.9 * x, params)
  batch = _vlm_batch()
  spec = prefix.PrefixSpec(TINY_VISION.num_patches + 3, 4)
  layout, info = spec.with_metrics(batch)
  assert info["share_prompts"] == 4 and info["share_token_ratio"] > 1.5
  assert max(_spans(layout["prefix_index"], 4).values()) == 3  # a group in 3 micro-batches
  hp = StepHParams(loss=losses.LossConfig(entropy_coef=0.01, kl_coef=0.05), max_new_tokens=N)
  padded = tiny.vlm_grads(mesh, graphdef, params, hp, batch, 1, ref=ref)
  prefixed = tiny.vlm_grads(mesh, graphdef, params, hp, layout, 4, ref=ref, prefixed=True)
  tiny.assert_vlm_grads_equal(prefixed, padded)
  (_, _, g1, c1), c0 = prefixed, padded[3]
  assert float(np.abs(g1["vision"]["patch_embed"]["kernel"]).max()) > 0
  assert {k: int(v) for k, v in c1.items()} == {k: int(v) for k, v in c0.items()}
  assert int(c1["encoder_backward_passes"]) == 1
