"""SigLIP and LLaVA checkpoints: knitjax against transformers on tiny random models.

Every checkpoint is written by transformers itself (`save_pretrained`, both of its formats) or
renamed to transformers 4.x's names; every weight is redrawn so activations and logits are O(1)
(the default init's zero biases and unit norms would hide a dropped bias or a swapped norm).
"""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from knitjax import sharding
from knitjax.models import hf, hf_vision, safetensors_io
from knitjax.models.vision import VisionEncoder
from knitjax.models.vlm import VLM, make_prompt_embedder
from knitjax.rollout.sampler import Sampler, SamplingConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
IMAGE = 30  # not a multiple of the 4-pixel patch: the convolution drops 2 rows and columns
SIGLIP = dict(
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=3,
  num_attention_heads=4,
  image_size=IMAGE,
  patch_size=4,
  layer_norm_eps=1e-5,
)
TEXT = dict(
  vocab_size=96,
  hidden_size=48,
  intermediate_size=64,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  rms_norm_eps=1e-5,
)
IMG, PAD, EOS = 7, 0, 1
LLAVAS = {
  # SigLIP (tanh GELU, pooling head kept) + Qwen2 (tied), LLaVA's defaults: layer -2, "default".
  "qwen2": dict(
    text=dict(TEXT, model_type="qwen2", tie_word_embeddings=True, rope_theta=1e6),
    vision=dict(SIGLIP, hidden_act="gelu_pytorch_tanh", vision_use_head=True),
    llava=dict(vision_feature_layer=-2, vision_feature_select_strategy="default"),
  ),
  # SigLIP (exact GELU, no head) + Llama (untied), "full", two feature layers, tanh projector.
  "llama": dict(
    text=dict(TEXT, model_type="llama", tie_word_embeddings=False, rope_theta=5e5),
    vision=dict(SIGLIP, hidden_act="gelu", vision_use_head=False),
    llava=dict(
      vision_feature_layer=[1, -1],
      vision_feature_select_strategy="full",
      projector_hidden_act="gelu_pytorch_tanh",
    ),
  ),
}


def _redraw(model, seed):
  """Weights ~ N(0, 1/fan_in), norm scales 1 + 0.1 noise, biases 0.1 noise."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if p.ndim == 1 and "norm" in name and name.endswith("weight"):
        p.copy_(1 + 0.1 * noise)
      elif p.ndim == 1:
        p.copy_(0.1 * noise)
      else:
        p.copy_(noise / np.sqrt(np.prod(p.shape[1:])))
  return model.eval()


def _images(n, seed=0):
  return np.random.default_rng(seed).integers(0, 256, (n, IMAGE, IMAGE, 3)).astype(np.uint8)


def _pixels(images):
  """SigLIP's processor: (x / 255 - 0.5) / 0.5, NCHW."""
  x = (images.astype(np.float32) / 255 - 0.5) / 0.5
  return torch.from_numpy(x.transpose(0, 3, 1, 2).copy())


def _rename(src, dst, rename):
  """Copies a checkpoint folder with every tensor renamed (transformers 4.x's names)."""
  os.makedirs(dst)
  shutil.copy(os.path.join(src, "config.json"), dst)
  tensors = hf.read_safetensors(src)
  items = [(rename(k), v.shape, v.dtype, lambda v=v: v) for k, v in sorted(tensors.items())]
  safetensors_io.write_streamed(os.path.join(dst, hf.WEIGHTS_FILE), items)


def _same_weights(a, b):
  sa, sb = a.state_dict(), b.state_dict()
  assert sorted(sa) == sorted(sb)
  for k in sa:
    torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


# ---------------------------------------------------------------------------------------------
# SigLIP


@pytest.fixture(scope="module")
def siglip(tmp_path_factory):
  root = tmp_path_factory.mktemp("siglip")
  config = transformers.SiglipVisionConfig(**SIGLIP, vision_use_head=True)
  model = _redraw(transformers.SiglipVisionModel(config), seed=0)
  model.save_pretrained(root / "v5")
  _rename(root / "v5", root / "v4", lambda k: "vision_model." + k)
  return model, root


@nnx.jit
def _siglip_outputs(encoder, images):
  return encoder.last_hidden_state(images), encoder.pooled(images)


def _abstract_encoder(config):
  return nnx.split(nnx.eval_shape(lambda: VisionEncoder(config, rngs=nnx.Rngs(0))))


def test_siglip_matches_transformers_in_both_namings(siglip):
  """last_hidden_state and the attention-pooled pooler_output, 5.x and 4.x names."""
  model, root = siglip
  assert "vision_model.head.probe" in hf.read_safetensors(root / "v4")
  images = _images(3)
  with torch.no_grad():
    want = model(pixel_values=_pixels(images))
    # transformers itself reads the 4.x names into the same weights.
    _same_weights(model, transformers.SiglipVisionModel.from_pretrained(root / "v4"))
  config = hf_vision.siglip_config_from_hf(root / "v5")
  assert (config.num_patches, config.mlp_act, config.pool_head) == (49, "gelu_tanh", True)
  for naming in ("v5", "v4"):
    graphdef, abstract = _abstract_encoder(config)
    params = hf_vision.load_siglip_params(root / naming, abstract)
    last, pooled = _siglip_outputs(nnx.merge(graphdef, params), images)
    np.testing.assert_allclose(last, want.last_hidden_state.numpy(), rtol=0, atol=ATOL)
    np.testing.assert_allclose(pooled, want.pooler_output.numpy(), rtol=0, atol=ATOL)
    assert np.abs(want.pooler_output.numpy()).max() > 0.5  # O(1) values, not a vacuous match


def test_siglip_export_round_trips_and_loads_in_transformers(siglip, tmp_path):
  model, root = siglip
  config = hf_vision.siglip_config_from_hf(root / "v5")
  graphdef, abstract = _abstract_encoder(config)
  params = hf_vision.load_siglip_params(root / "v5", abstract)
  for naming in ("v5", "v4"):
    hf_vision.save_siglip(params, config, tmp_path / naming, naming=naming)
    assert (
      hf.read_safetensors(tmp_path / naming).keys() == hf.read_safetensors(root / naming).keys()
    )
    again = hf_vision.load_siglip_params(tmp_path / naming, abstract)
    for (k, a), (_, b) in zip(nnx.to_flat_state(params), nnx.to_flat_state(again), strict=True):
      np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg=str(k))
    _same_weights(model, transformers.SiglipVisionModel.from_pretrained(tmp_path / naming))


# ---------------------------------------------------------------------------------------------
# LLaVA


def _llava_model(case, seed):
  c = LLAVAS[case]
  config = transformers.LlavaConfig(
    vision_config=transformers.SiglipVisionConfig(**c["vision"]),
    text_config=c["text"],
    image_token_index=IMG,
    **c["llava"],
  )
  return _redraw(transformers.LlavaForConditionalGeneration(config), seed)


@pytest.fixture(scope="module")
def llavas(tmp_path_factory):
  """Per case: the transformers model and its checkpoint in every naming."""
  out = {}
  for seed, case in enumerate(LLAVAS):
    root = tmp_path_factory.mktemp(f"llava_{case}")
    model = _llava_model(case, seed)
    model.save_pretrained(root / "saved")  # 5.x default: 4.x outer names, no `vision_model.`
    model.save_pretrained(root / "v5", save_original_format=False)
    _rename(
      root / "saved",
      root / "v4",
      lambda k: k.replace("vision_tower.", "vision_tower.vision_model."),
    )
    out[case] = model, root
  return out


def _prompts(num_tokens):
  """Two rows, each BOS, the image's placeholders as LLaVA expands them, text; row 1 left-padded."""
  rng = np.random.default_rng(3)
  rows = [
    [2, *([IMG] * num_tokens), *rng.integers(10, 96, 4)],
    [2, *([IMG] * num_tokens), *rng.integers(10, 96, 2)],
  ]
  length = max(map(len, rows))
  tokens = np.full((2, length), PAD, np.int32)
  for b, row in enumerate(rows):
    tokens[b, length - len(row) :] = row
  valid = tokens != PAD
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
  return tokens, valid, positions, valid.sum(1).astype(np.int32)


@nnx.jit
def _forward(model, tokens, positions, valid, images):
  return model(tokens, positions, valid, images_bhwc=images)


def _hf_logits(model, tokens, valid, positions, images):
  with torch.no_grad():
    return model(
      input_ids=torch.from_numpy(tokens).long(),
      attention_mask=torch.from_numpy(valid).long(),
      position_ids=torch.from_numpy(positions).long(),
      pixel_values=_pixels(images),
    ).logits.numpy()


@pytest.mark.parametrize("case", sorted(LLAVAS))
def test_llava_logits_and_greedy_tokens_match_transformers(llavas, case):
  """Logits of an image prompt in every naming, and greedy generation through knitjax's sampler
  (image embeddings into the prefill) against `generate(do_sample=False)`."""
  model, root = llavas[case]
  lm_config, vision_config, token = hf_vision.llava_config_from_hf(root / "v5")
  assert token == IMG and hf_vision.is_llava(root / "v5")
  tokens, valid, positions, lens = _prompts(vision_config.num_image_tokens)
  images = _images(2, seed=1)
  want = _hf_logits(model, tokens, valid, positions, images)
  assert np.abs(want[valid]).max() > 1.0
  for naming in ("saved", "v5", "v4"):
    _, _, _, graphdef, params = hf_vision.init_vlm_from_hf(root / naming)
    got = _forward(nnx.merge(graphdef, params), tokens, positions, valid, images)
    np.testing.assert_allclose(np.asarray(got)[valid], want[valid], rtol=0, atol=ATOL)

  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  embed = make_prompt_embedder(graphdef, mesh)(params, tokens, images, np.arange(2, dtype=np.int32))
  sampler = Sampler(
    graphdef,
    mesh=mesh,
    sampling=SamplingConfig(max_new_tokens=6, temperature=0.0),
    eos_id=EOS,
    pad_id=PAD,
    prompt_len=tokens.shape[1],
  )
  samples = sampler(params, tokens, lens, jax.random.key(0), embeddings=embed)
  with torch.no_grad():
    generated = model.generate(
      input_ids=torch.from_numpy(tokens).long(),
      attention_mask=torch.from_numpy(valid).long(),
      pixel_values=_pixels(images),
      do_sample=False,
      max_new_tokens=6,
      eos_token_id=EOS,
      pad_token_id=PAD,
    )
  np.testing.assert_array_equal(samples.tokens, generated[:, tokens.shape[1] :].numpy())


def test_llava_feature_layer_and_strategy_are_not_ignored(llavas):
  """The same weights read with the previous feature layer, or keeping the first patch, are far
  from transformers: the parity above depends on both options."""
  import dataclasses

  model, root = llavas["qwen2"]
  lm_config, vision_config, token, _, params = hf_vision.init_vlm_from_hf(root / "v5")
  tokens, valid, positions, _ = _prompts(vision_config.num_image_tokens)
  images = _images(2, seed=1)
  want = _hf_logits(model, tokens, valid, positions, images)
  for wrong in (dict(feature_layers=(-1,)), dict(drop_first_token=False)):
    vc = dataclasses.replace(vision_config, **wrong)
    graphdef = nnx.split(
      nnx.eval_shape(lambda vc=vc: VLM(lm_config, vc, image_token_id=token, rngs=nnx.Rngs(0)))
    )[0]
    got = np.asarray(_forward(nnx.merge(graphdef, params), tokens, positions, valid, images))
    assert np.abs(got[valid] - want[valid]).max() > 100 * ATOL, wrong


@pytest.mark.parametrize("case", sorted(LLAVAS))
def test_llava_export_round_trips_and_loads_in_transformers(llavas, case, tmp_path):
  """load -> save_llava -> load is bitwise; transformers reads each exported naming into the
  original weights."""
  model, root = llavas[case]
  lm_config, vision_config, token, graphdef, params = hf_vision.init_vlm_from_hf(root / "saved")
  for naming in ("v5", "v4"):
    out = tmp_path / naming
    hf_vision.save_llava(params, lm_config, vision_config, token, out, naming=naming)
    assert hf.read_safetensors(out).keys() == hf.read_safetensors(root / naming).keys()
    *_, again = hf_vision.init_vlm_from_hf(out)
    for (k, a), (_, b) in zip(nnx.to_flat_state(params), nnx.to_flat_state(again), strict=True):
      np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg=str(k))
    _same_weights(model, transformers.LlavaForConditionalGeneration.from_pretrained(out))
    with open(out / "config.json") as f:
      assert json.load(f)["vision_feature_layer"] == LLAVAS[case]["llava"]["vision_feature_layer"]


def test_llava_loader_names_what_it_cannot_use(llavas, tmp_path):
  _, root = llavas["qwen2"]
  _rename(root / "v5", tmp_path / "extra", lambda k: k.replace("projector.linear_2", "extra"))
  with pytest.raises(ValueError, match="'model.multi_modal_extra.bias' .* not part of a LLaVA"):
    hf_vision.init_vlm_from_hf(tmp_path / "extra")
  with open(root / "v5" / "config.json") as f:
    config = json.load(f)
  config["vision_config"]["model_type"] = "clip_vision_model"
  with pytest.raises(ValueError, match="not a SigLIP vision tower"):
    hf_vision.llava_config_from_hf(config)
  config["vision_config"]["model_type"] = "siglip_vision_model"
  config["vision_feature_select_strategy"] = "cls"
  with pytest.raises(ValueError, match="vision_feature_select_strategy='cls'"):
    hf_vision.llava_config_from_hf(config)


def test_init_vlm_from_hf_shards_params_by_the_rules(llavas):
  """On a (2, 2, 2) mesh every param gets the rules table's sharding and the unsharded values."""
  _, root = llavas["llama"]
  mesh = sharding.make_mesh((2, 2, 2))
  *_, graphdef, params = hf_vision.init_vlm_from_hf(root / "v5", mesh)
  *_, plain = hf_vision.init_vlm_from_hf(root / "v5")
  want = nnx.to_flat_state(sharding.state_shardings(nnx.split(nnx.merge(graphdef, plain))[1], mesh))
  got = nnx.to_flat_state(params)
  for (k, s), (_, a), (_, b) in zip(want, got, nnx.to_flat_state(plain), strict=True):
    assert a.get_value().sharding == s.get_value(), k
    np.testing.assert_array_equal(a.get_value(), b.get_value())
  kernel = params["vision"]["blocks"][0]["attn"]["q_kernel"].get_value()
  assert not kernel.sharding.is_fully_replicated
