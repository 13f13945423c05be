"""Vision encoder, projector and VLM wiring: patch order, bidirectional attention, sharding,
placeholder splicing, cached prefill, and sampling from image prompts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from knitjax import sharding
from knitjax.models.vision import VisionEncoder, patchify
from knitjax.models.vlm import VLM, make_prompt_embedder, splice_image_rows
from knitjax.rollout.sampler import Sampler, SamplingConfig
from tests.tiny import TINY, TINY_VISION

LM, VC = TINY, TINY_VISION
IMG = 3


def _images(n, seed=0):
  return np.random.default_rng(seed).integers(0, 256, (n, 8, 8, 3)).astype(np.uint8)


def test_patchify_matches_a_strided_convolution():
  """Patch embedding as reshape + matmul equals SigLIP's stride-p convolution (HWIO kernel)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 8, 8, 3)).astype(np.float32)
  kernel = rng.normal(size=(4 * 4 * 3, 5)).astype(np.float32)
  ours = patchify(jnp.asarray(x), 4) @ kernel
  conv = jax.lax.conv_general_dilated(
    x, kernel.reshape(4, 4, 3, 5), (4, 4), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  np.testing.assert_allclose(ours, conv.reshape(2, 4, 5), rtol=1e-5, atol=1e-5)


def test_encoder_attention_is_bidirectional():
  """Permuting patches together with their position embeddings permutes the outputs: every
  patch sees every other (no causal mask), and there is no class token."""
  encoder = VisionEncoder(VC, rngs=nnx.Rngs(0))
  encode = nnx.jit(lambda m, x: m(x))
  images = _images(1)
  out = encode(encoder, images)
  assert out.shape == (1, VC.num_patches, VC.d_model)
  # Swap the top-left and bottom-right patches, and their position embeddings.
  swapped = images.copy()
  swapped[:, :4, :4], swapped[:, 4:, 4:] = images[:, 4:, 4:], images[:, :4, :4]
  pos = encoder.pos_embed[...]
  encoder.pos_embed[...] = pos[jnp.array([3, 1, 2, 0])]
  out2 = encode(encoder, swapped)
  np.testing.assert_allclose(out2[:, [3, 1, 2, 0]], out, rtol=1e-5, atol=1e-5)
  # The first patch's output depends on the last patch's pixels.
  changed = images.copy()
  changed[:, 4:, 4:] = 255 - changed[:, 4:, 4:]
  assert not np.allclose(encode(encoder, changed)[:, 0], out2[:, 3], atol=1e-3)


def test_vision_params_are_sharded_by_logical_axes():
  """Shardings the rules table gives the VLM's params on a (2, 2, 2) mesh (abstract: no init)."""
  mesh = sharding.make_mesh((2, 2, 2))
  _, abstract = nnx.split(nnx.eval_shape(lambda: VLM(LM, VC, image_token_id=IMG, rngs=nnx.Rngs(0))))
  shardings = sharding.state_shardings(abstract, mesh)
  block = shardings["vision"]["blocks"][0]
  assert block["attn"]["q_kernel"].get_value().spec == P("fsdp", "tensor", None)
  assert block["fc1"]["kernel"].get_value().spec == P("fsdp", "tensor")
  assert shardings["projector"]["fc2"]["kernel"].get_value().spec == P("tensor", "fsdp")
  assert shardings["vision"]["pos_embed"].get_value().spec == P(None, "fsdp")
  # Every array of at least 1024 elements is split somewhere.
  sizes = [x.size for x in jax.tree.leaves(abstract)]
  specs = jax.tree.leaves(shardings)
  assert len(sizes) == len(specs)
  for size, spec in zip(sizes, specs, strict=True):
    assert size < 1024 or not spec.is_fully_replicated, spec


def test_splice_replaces_placeholders_in_order():
  tokens = jnp.array([[1, IMG, 7, IMG, IMG, 9], [1, 5, 6, 7, 8, 9]])
  x = jnp.arange(2 * 6 * 2, dtype=jnp.float32).reshape(2, 6, 2)
  rows = -jnp.arange(2 * 3 * 2, dtype=jnp.float32).reshape(2, 3, 2) - 1
  out = splice_image_rows(x, tokens, rows, IMG)
  np.testing.assert_array_equal(out[0, [1, 3, 4]], rows[0])  # k-th placeholder <- patch k
  np.testing.assert_array_equal(out[0, [0, 2, 5]], x[0, [0, 2, 5]])
  np.testing.assert_array_equal(out[1], x[1])  # no placeholders: untouched


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh((1, 2, 1), devices=jax.devices()[:2])


@pytest.fixture(scope="module")
def vlm(mesh):
  return sharding.init_sharded(lambda: VLM(LM, VC, image_token_id=IMG, rngs=nnx.Rngs(0)), mesh)


@nnx.jit
def _embed(model, tokens, images):
  return model.embed(tokens, model.encode_images(images))


@nnx.jit
def _forward(model, tokens, positions, valid, images):
  return model(tokens, positions, valid, images_bhwc=images)


def _prompts(batch=4, prompt_len=8):
  """Left-padded prompts: BOS, 4 placeholders, 1-2 question tokens."""
  rng = np.random.default_rng(1)
  tokens = np.zeros((batch, prompt_len), np.int32)
  lens = np.zeros(batch, np.int32)
  for b in range(batch):
    p = [1] + [IMG] * VC.num_patches + list(rng.integers(4, 32, 1 + b % 2))
    tokens[b, prompt_len - len(p) :] = p
    lens[b] = len(p)
  return tokens, lens


def test_cached_prefill_and_sampling_see_the_image(vlm, mesh):
  """The sampler's prefill with image embeddings gives the trainer's log-probs; images matter."""
  graphdef, params = vlm
  tokens, lens = _prompts()
  images = _images(2)
  index = np.array([0, 1, 1, 0], np.int32)  # 2 unique images over 4 rows
  embed = make_prompt_embedder(graphdef, mesh)
  emb = embed(params, tokens, images, index)
  model = nnx.merge(graphdef, jax.device_get(params))
  # Embedder == per-row encoding and splicing, to float32 rounding (the two programs sum in
  # different orders: up to 1.1e-6 apart at XLA's -O0, which the suite compiles with).
  want = _embed(model, tokens, images[index])
  np.testing.assert_allclose(emb, want, rtol=1e-5, atol=2e-6)

  sampler = Sampler(
    graphdef,
    mesh=mesh,
    sampling=SamplingConfig(max_new_tokens=3),
    eos_id=99,
    pad_id=0,
    prompt_len=8,
  )
  samples = sampler(params, tokens, lens, jax.random.key(0), embeddings=emb)
  full = np.concatenate([tokens, samples.tokens], axis=1)
  valid = np.concatenate([tokens != 0, np.ones_like(samples.tokens, bool)], axis=1)
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
  logits = _forward(model, full, positions, valid, images[index])
  logp = jax.nn.log_softmax(logits[:, 7:10], axis=-1)
  picked = np.take_along_axis(np.asarray(logp), samples.tokens[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(samples.logprobs, picked, rtol=1e-4, atol=1e-5)
  # Another image changes the next-token distribution of the same text.
  other = _forward(model, full, positions, valid, images[1 - index])
  assert not np.allclose(other[:, 7], logits[:, 7], atol=1e-3)
