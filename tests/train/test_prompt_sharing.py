"""Shared-prompt training (`knitjax.train.prompt_sharing`): the layout's invariants, and log-probs,
losses, in-step advantages and gradients equal to the padded layout's (float32; tolerances at
each assertion: rtol 1e-5 on log-probs, loss and metrics, rtol 1e-4 / atol 1e-6 on every gradient
entry, the packing tests' summation-order tolerances)."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from knitjax import sharding
from knitjax.train import losses, prompt_sharing
from knitjax.train.batch import make_batch, pad_rows
from knitjax.train.step import (
  StepHParams,
  forward,
)
from knitjax.train.step_advantages import AdvantageConfig
from tests import tiny
from tests.tiny import TINY

P, N, G = 6, 5, 4


def _groups_batch(seed=0, groups=3, g=G, *, fallback=True):
  """``groups`` groups of ``g`` responses to one prompt each; with ``fallback`` the last group's
  rows hold different prompts (each row its own unit)."""
  return tiny.groups_batch(seed, groups, g, p_len=P, n_new=N, fallback=fallback)


def _share(batch, *, multiple=2, pack=False, seq_len=P + G * N):
  return prompt_sharing.share_batch(
    batch, prompt_len=P, seq_len=seq_len, pack=pack, multiple=multiple
  )


def test_hand_example_layout():
  prompts = [np.array([5, 6, 7])] * 2
  responses = [np.array([8, 9]), np.array([10])]
  batch = make_batch(
    pad_rows(prompts, responses, [np.array([-1.0, -2.0]), np.array([-3.0])]),
    np.array([0.5, -0.5]), prompt_len=4, max_new_tokens=2, pad_id=0, group_ids=np.array([1, 1]),
  )  # fmt: skip
  # Fixed spans (pack=False): the prompt left-padded in [0, 4), the responses at 4 and 6.
  out = prompt_sharing.share_batch(batch, prompt_len=4, seq_len=8, multiple=1)
  np.testing.assert_array_equal(out["tokens"][0], [0, 5, 6, 7, 8, 9, 10, 0])
  np.testing.assert_array_equal(out["positions"][0], [0, 0, 1, 2, 3, 4, 3, 0])
  np.testing.assert_array_equal(out["segment_ids"][0], [0, 1, 1, 1, 2, 2, 3, 0])
  np.testing.assert_array_equal(out["prefix_ids"][0], [0, 0, 0, 0, 1, 1, 1, 0])
  np.testing.assert_array_equal(out["score_index"][0], [0, 1, 2, 3, 3, 4, 3, 7])
  # Contiguous (pack=True): [prompt | r1 | r2], then padding.
  out = prompt_sharing.share_batch(batch, prompt_len=4, seq_len=8, multiple=1, pack=True)
  np.testing.assert_array_equal(out["tokens"][0], [5, 6, 7, 8, 9, 10, 0, 0])
  np.testing.assert_array_equal(out["positions"][0], [0, 1, 2, 3, 4, 3, 0, 0])
  np.testing.assert_array_equal(out["segment_ids"][0], [1, 1, 1, 2, 2, 3, 0, 0])
  np.testing.assert_array_equal(out["prefix_ids"][0], [0, 0, 0, 1, 1, 1, 0, 0])
  # Response tokens are scored where they sit, from the token before them (the prompt's last,
  # column 2, for both first tokens).
  np.testing.assert_array_equal(out["score_index"][0], [0, 1, 2, 2, 3, 2, 6, 7])
  np.testing.assert_array_equal(out["targets"][0][3:6], [8, 9, 10])
  np.testing.assert_array_equal(out["loss_mask"][0], [0, 0, 0, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(out["behavior_logp"][0][3:6], [-1.0, -2.0, -3.0])
  np.testing.assert_array_equal(out["advantages"][0], [0, 0, 0, 0.5, 0.5, -0.5, 0, 0])
  np.testing.assert_array_equal(out["group_id"][0], [-1, -1, -1, 1, 1, 1, -1, -1])


def test_units_share_only_identical_prompts_with_responses():
  batch = _groups_batch(seed=1)
  assert prompt_sharing.units(batch, P) == [[0, 1, 2, 3], [4, 5, 6, 7], [8], [9], [10], [11]]
  batch["valid"][5, P:] = False  # an empty response: its group falls back to a unit per row
  assert prompt_sharing.units(batch, P)[:5] == [[0, 1, 2, 3], [4], [5], [6], [7]]


def test_tokens_cut_by_the_token_ratio():
  """Equal lengths: ``G (P + R) / (P + G R)`` exactly, the issue's ratio."""
  rows = pad_rows([np.arange(3, 3 + P)] * 8, [np.arange(3, 3 + N)] * 8, [np.zeros(N)] * 8)
  batch = make_batch(
    rows, np.zeros(8), prompt_len=P, max_new_tokens=N, pad_id=0, group_ids=np.zeros(8, int)
  )
  out, metrics = prompt_sharing.ShareSpec(P, P + 8 * N, 1).with_metrics(batch)
  assert metrics["share_token_ratio"] == pytest.approx(8 * (P + N) / (P + 8 * N))
  assert metrics["share_tokens"] == P + 8 * N and out["valid"].shape == (1, P + 8 * N)


@pytest.mark.parametrize("pack", [False, True])
def test_every_scored_token_once_with_its_target_and_position(pack):
  batch = _groups_batch(seed=2)
  out = _share(batch, pack=pack, seq_len=P + G * N + (3 if pack else 0))

  # Each loss token of the padded rows appears once, with its behaviour log-prob and target.
  def scored(b):
    m = b["loss_mask"] > 0
    return sorted(zip(b["behavior_logp"][m].tolist(), b["targets"][m].tolist(), strict=True))

  padded, shared = scored(batch), scored(out)
  assert padded == shared
  assert out["valid"].sum() < batch["valid"].sum()
  assert out["valid"].shape[0] % 2 == 0


def _by_behavior(batch, values):
  """Per loss token (keyed by its unique behaviour log-prob), the value at its scoring column."""
  m = np.asarray(batch["loss_mask"]) > 0
  keys, vals = np.asarray(batch["behavior_logp"])[m], np.asarray(values)[m]
  return dict(zip(keys.tolist(), vals.tolist(), strict=True))


def _assert_same_tokens(shared_batch, shared_values, padded_batch, padded_values, rtol):
  a = _by_behavior(shared_batch, shared_values)
  b = _by_behavior(padded_batch, padded_values)
  assert a.keys() == b.keys()
  keys = sorted(b)
  np.testing.assert_allclose([a[k] for k in keys], [b[k] for k in keys], rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("spans", [None, (P, N)])
def test_logprobs_equal_the_padded_rows(spans):
  """The forward of either layout, every loss token's log-prob and entropy (rtol 1e-5); fixed
  spans attended by the tree mask's ids (None) or span by span (``attend_spans``)."""
  batch = _groups_batch(seed=3)
  shared = _share(batch)
  graphdef, params = tiny.init()
  run = jax.jit(
    lambda p, mb, spans: forward(nnx.merge(graphdef, p), mb, temperature=1.0, chunk=4, spans=spans),
    static_argnums=2,
  )
  lp0, ent0, _ = run(params, dict(batch), None)
  lp1, ent1, _ = run(params, dict(shared), spans)
  _assert_same_tokens(shared, lp1, batch, lp0, 1e-5)
  _assert_same_tokens(shared, ent1, batch, ent0, 1e-5)


MODES = {
  "grpo": (dict(kl_coef=0.05, entropy_coef=0.01), AdvantageConfig()),
  "gspo": (dict(ratio_level="sequence", aggregation="seq_mean_token_mean", kl_coef=0.05),
           AdvantageConfig()),
  "gae_kl_reward": (dict(kl_coef=0.05, kl_penalty="reward"),
                    AdvantageConfig(estimator="gae", gamma=0.95, gae_lambda=0.9)),
  "grpo_kl_reward": (dict(kl_coef=0.05, kl_penalty="reward"), AdvantageConfig()),
}  # fmt: skip


def _step(mesh, batch, mode, *, shared, spans=None, micro_batches=2):
  loss_kw, advantage = MODES[mode]
  hp = StepHParams(
    loss=losses.LossConfig(**loss_kw), advantage=advantage, max_new_tokens=N, shared_spans=spans
  )

  def critic_predicts(params):  # a critic that predicts something: GAE bootstraps real values
    params["value_head"]["bias"][...] = params["value_head"]["bias"][...] + 0.3

  before, after, metrics = tiny.train_step(
    mesh, batch, hp, micro_batches=micro_batches, ref_scale=0.9, packed=shared, shared=shared,
    config=dataclasses.replace(TINY, value_head=advantage.critic),
    edit_params=critic_predicts if advantage.critic else None,
  )  # fmt: skip
  return tiny.gradient(before, after), metrics


def _assert_steps_equal(g0, m0, g1, m1):
  assert m0["grad_norm"] > 0 and m0["kl"] != 0
  assert (m1["num_seqs"], m1["num_tokens"]) == (m0["num_seqs"], m0["num_tokens"])
  for key in sorted(m0):
    np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5, atol=1e-6, err_msg=key)
  tiny.assert_trees_close(g1, g0, rtol=1e-4, atol=1e-6)


# Each case compiles two steps (~10-20 s on two busy cores).
@pytest.mark.parametrize(
  "mode,pack,devices",
  [("grpo", False, 2), ("gspo", True, 1), ("gae_kl_reward", False, 1), ("grpo_kl_reward", True, 2)],
)
def test_step_equals_padded_step(mode, pack, devices):
  """Loss, metrics (KL, clip fractions, in-step advantages' metrics) and the SGD update of the
  shared layout equal the padded layout's; packed shared units and a 2-device mesh too."""
  mesh = sharding.make_mesh((devices, 1, 1), devices=jax.devices()[:devices])
  batch = _groups_batch(seed=4)
  shared = _share(batch, multiple=2 * devices, pack=pack, seq_len=P + G * N + (7 if pack else 0))
  g0, m0 = _step(mesh, batch, mode, shared=False)
  g1, m1 = _step(mesh, shared, mode, shared=True, spans=None if pack else (P, N))
  _assert_steps_equal(g0, m0, g1, m1)
  if MODES[mode][1].critic:
    assert m0["value_loss"] > 0


def test_lora_step_equals_padded_step():
  """LoRA (adapters trained, the frozen base the reference): the shared update is the padded one."""
  mesh = tiny.one_device_mesh()
  graphdef, adapters, base = tiny.lora_model(mesh)  # B != 0: the adapters matter
  batch = _groups_batch(seed=5)
  out = []
  for b, shared in ((batch, False), (_share(batch), True)):
    spans = (P, N) if shared else None
    hp = StepHParams(loss=losses.LossConfig(kl_coef=0.05), max_new_tokens=N, shared_spans=spans)
    out.append(tiny.lora_step(mesh, graphdef, adapters, base, b, hp, packed=shared, shared=shared))
  (p0, m0), (p1, m1) = out
  assert m0["kl"] != 0
  for key in sorted(m0):
    np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5, atol=1e-6, err_msg=key)
  tiny.assert_trees_close(p1, p0, rtol=1e-4, atol=1e-6)


def test_plan_parts_agrees_with_the_layout():
  """Consumers agree on a sequence count from token counts alone (GroupMeta's); it is what the
  layout needs, with the same metrics."""
  batch = _groups_batch(seed=6, fallback=False)
  spec = prompt_sharing.ShareSpec(P, P + G * N + 7, 2, pack=True)
  valid = batch["valid"]
  counts = [
    (tuple(valid[r, :P].sum() for r in rows), tuple(valid[r, P:].sum() for r in rows))
    for rows in np.arange(len(valid)).reshape(-1, G)
  ]
  count, metrics = spec.plan_parts([counts], row_len=P + N)
  shared, own = spec.with_metrics(batch)
  assert shared["valid"].shape[0] == count
  assert metrics == own


def test_errors_name_the_problem():
  batch = _groups_batch(seed=7)
  with pytest.raises(ValueError, match="raise config.layout.pack_len"):
    _share(batch, seq_len=P + N)
  with pytest.raises(ValueError, match="count=2"):
    prompt_sharing.share_batch(batch, prompt_len=P, seq_len=P + G * N, multiple=2, count=2)


def _vlm_batch(seed=0):
  """Groups of G responses to one image prompt each (two groups share image 0; one group is text
  only), rows shuffled so each group's members spread over micro-batches."""
  from tests.tiny import TINY_VISION as VC  # noqa: PLC0415

  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (2, VC.image_size, VC.image_size, 3)).astype(np.uint8)
  prompts, responses, logps, index, groups = [], [], [], [], []
  for group, image in enumerate((0, 1, 0, -1)):
    head = [1] + [3] * VC.num_patches if image >= 0 else [1]
    prompt = np.concatenate([head, rng.integers(4, 32, rng.integers(1, 3))]).astype(np.int32)
    for _ in range(G):
      n = rng.integers(1, N + 1)
      prompts.append(prompt)
      responses.append(rng.integers(4, 32, n).astype(np.int32))
      logps.append(rng.normal(-3.0, 0.5, n).astype(np.float32))
      index.append(image)
      groups.append(group)
  rows = len(prompts)
  batch = make_batch(
    pad_rows(prompts, responses, logps), rng.normal(size=rows).astype(np.float32),
    prompt_len=VC.num_patches + 3, max_new_tokens=N, pad_id=0, group_ids=np.array(groups),
  )  # fmt: skip
  batch["image_index"] = np.asarray(index, np.int32)
  perm = rng.permutation(rows)
  return {**{k: v[perm] for k, v in batch.items()}, "images": images}


def test_vlm_step_equals_padded_step():
  """A VLM batch (encoder dedup): loss, metric sums and every part's gradient (vision, projector,
  backbone) of the shared layout equal the padded layout's (rtol 1e-5 on the loss and sums, 1e-4
  / atol 1e-6 on each gradient entry); each image's tokens pass the backbone once per group."""
  from knitjax.models.vlm import VLM  # noqa: PLC0415
  from tests.tiny import TINY_VISION  # noqa: PLC0415

  mesh = tiny.one_device_mesh()
  graphdef, params = sharding.init_sharded(
    lambda: VLM(TINY, TINY_VISION, image_token_id=3, rngs=nnx.Rngs(0)), mesh
  )
  ref = jax.tree.map(lambda x: 0.9 * x, params)
  batch = _vlm_batch()
  prompt_len = TINY_VISION.num_patches + 3
  spec = prompt_sharing.ShareSpec(prompt_len, prompt_len + G * N, 2)
  shared, info = spec.with_metrics(batch)
  assert shared["valid"].shape[0] == 4 and info["share_token_ratio"] > 1.5
  out = []
  for b, is_shared in ((batch, False), (shared, True)):
    hp = StepHParams(
      loss=losses.LossConfig(entropy_coef=0.01, kl_coef=0.05), max_new_tokens=N,
      shared_spans=(prompt_len, N) if is_shared else None,
    )  # fmt: skip
    out.append(tiny.vlm_grads(mesh, graphdef, params, hp, b, 2, ref=ref, shared=is_shared))
  tiny.assert_vlm_grads_equal(out[1], out[0])
  c0, c1 = out[0][3], out[1][3]
  assert int(c1["encoder_images_encoded"]) == int(c0["encoder_images_encoded"])
