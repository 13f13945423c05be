"""Parity with transformers itself (torch float32, CPU) on tiny random checkpoints it wrote.

Each case builds a model with transformers' own classes, redraws every weight so that logits are
O(1) (the default init's tiny weights hide errors), saves it with `save_pretrained` and loads it
back on both sides. On left-padded prompts long enough that RoPE scaling matters (positions past
the tiny `original_max_position_embeddings` = 32), knitjax must give transformers' logits within
1e-4, the same greedy tokens through its own `Sampler` (prefill + KV-cache decode) as
`generate(do_sample=False)`, and decode log-probs equal to its full forward's.
"""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from knitjax import sharding  # noqa: E402
from knitjax.models import hf  # noqa: E402
from knitjax.models.transformer import Transformer  # noqa: E402
from knitjax.rollout.sampler import Sampler, SamplingConfig  # noqa: E402

ATOL = 1e-4  # float32 on both sides, logits of std ~1; measured max differences about 4e-6
VOCAB, PROMPT_LEN, NEW = 300, 40, 16
PROMPT_LENS = np.array([40, 23, 9], np.int32)  # left padding in all but the first row
BASE = dict(
  vocab_size=VOCAB,
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  max_position_embeddings=128,
  rms_norm_eps=1e-6,
)
LLAMA3 = dict(
  rope_type="llama3",
  rope_theta=10_000.0,
  factor=4.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  original_max_position_embeddings=32,
)
# name -> (config class, config fields, how the folder is written)
CASES = {
  "qwen2_untied": ("Qwen2Config", dict(tie_word_embeddings=False, rope_theta=1e6), "single"),
  "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6), "single"),
  "qwen3_qk_norm": ("Qwen3Config", dict(tie_word_embeddings=True, rope_theta=1e6), "single"),
  "llama31": ("LlamaConfig", dict(rope_parameters=LLAMA3), "single"),
  "llama31_sharded": ("LlamaConfig", dict(rope_parameters=LLAMA3), "sharded"),
  "llama31_v4_config": ("LlamaConfig", dict(rope_parameters=LLAMA3), "v4_config"),
  "qwen2_yarn": (
    "Qwen2Config",
    dict(
      tie_word_embeddings=False,
      rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32
      ),
    ),
    "single",
  ),
  "llama_linear": (
    "LlamaConfig",
    dict(rope_parameters=dict(rope_type="linear", rope_theta=10_000.0, factor=2.0)),
    "single",
  ),
}
SCALED = ("llama31", "qwen2_yarn", "llama_linear")
# The sharded and v4-config variants hold the same weights as the single-file llama31 checkpoint.
SAME_WEIGHTS = {"llama31_sharded": "llama31", "llama31_v4_config": "llama31"}


def _redraw(model, seed: int) -> None:
  """Weights that make logits O(1): matrices N(0, 1/fan_in), norms 1 + 0.1 N, biases 0.1 N."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.1 * noise)
      elif name.endswith(".bias"):
        p.copy_(0.1 * noise)
      else:
        p.copy_(noise * p.shape[-1] ** -0.5)


def _write(name: str, path: str) -> None:
  cls_name, fields, variant = CASES[name]
  config = getattr(transformers, cls_name)(**BASE, **fields)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  _redraw(model, seed=sorted(CASES).index(SAME_WEIGHTS.get(name, name)))
  if variant == "sharded":
    model.save_pretrained(path, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(path, hf.INDEX_FILE))
  else:
    model.save_pretrained(path)
  if variant == "v4_config":  # transformers 4.x: top-level rope_theta + a rope_scaling dict
    config_path = os.path.join(path, hf.CONFIG_FILE)
    with open(config_path) as f:
      hf_config = json.load(f)
    rope = hf_config.pop("rope_parameters")
    hf_config["rope_theta"] = rope.pop("rope_theta")
    hf_config["rope_scaling"] = rope
    with open(config_path, "w") as f:
      json.dump(hf_config, f)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """name -> (checkpoint folder, transformers' greedy tokens and logits), built once per name."""
  made = {}

  def get(name: str):
    if name not in made:
      path = str(tmp_path_factory.mktemp(name))
      _write(name, path)
      made[name] = (path, *_hf_reference(path, *_prompts()))
    return made[name]

  return get


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])


def _prompts() -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, VOCAB, (len(PROMPT_LENS), PROMPT_LEN)).astype(np.int32)
  valid = np.arange(PROMPT_LEN)[None] >= PROMPT_LEN - PROMPT_LENS[:, None]
  return np.where(valid, tokens, 0).astype(np.int32), valid


def _hf_reference(path: str, prompts: np.ndarray, prompt_valid: np.ndarray):
  """transformers' greedy continuation [B, NEW] and its logits over [prompt | continuation]."""
  model = transformers.AutoModelForCausalLM.from_pretrained(
    path, dtype=torch.float32, attn_implementation="eager"
  ).eval()
  model.generation_config.eos_token_id = None  # never stop early; knitjax gets an unused eos id
  with torch.no_grad():
    out = model.generate(
      input_ids=torch.from_numpy(prompts).long(),
      attention_mask=torch.from_numpy(prompt_valid).long(),
      max_new_tokens=NEW,
      min_new_tokens=NEW,
      do_sample=False,
      pad_token_id=0,
    )
    generated = out[:, PROMPT_LEN:].numpy().astype(np.int32)
    tokens = np.concatenate([prompts, generated], axis=1)
    valid = np.concatenate([prompt_valid, np.ones_like(generated, bool)], axis=1)
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
    logits = model(
      input_ids=torch.from_numpy(tokens).long(),
      attention_mask=torch.from_numpy(valid).long(),
      position_ids=torch.from_numpy(positions).long(),
    ).logits.numpy()
  return generated, tokens, valid, positions, logits


@nnx.jit
def _forward(model, tokens, positions, valid):
  return model(tokens, positions, valid)


def _log_softmax(x: np.ndarray) -> np.ndarray:
  return np.asarray(jax.nn.log_softmax(x, axis=-1))


def _rope_type(config) -> str | None:
  return None if config.rope_scaling is None else config.rope_scaling.rope_type


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_greedy_tokens_match_transformers(reference, mesh, name):
  path, hf_generated, tokens, valid, positions, hf_logits = reference(name)
  config, graphdef, params = hf.init_from_hf(path, mesh)
  assert _rope_type(config) == CASES[name][1].get("rope_parameters", {}).get("rope_type")

  # (a) Full-sequence logits at every real position (the padded ones are not defined).
  logits = np.asarray(_forward(nnx.merge(graphdef, params), tokens, positions, valid))
  assert np.std(hf_logits[valid]) > 0.3  # weights were redrawn: logits of O(1), not ~0
  np.testing.assert_allclose(logits[valid], hf_logits[valid], atol=ATOL, rtol=0)

  # (b) knitjax's own sampler, greedy: prefill + KV-cache decode, the same tokens.
  sampler = Sampler(
    graphdef,
    mesh=mesh,
    sampling=SamplingConfig(max_new_tokens=NEW, temperature=0.0),
    eos_id=VOCAB,  # outside the vocabulary: never produced
    pad_id=0,
    prompt_len=PROMPT_LEN,
  )
  samples = sampler(params, tokens[:, :PROMPT_LEN], PROMPT_LENS, jax.random.key(0))
  np.testing.assert_array_equal(samples.tokens, hf_generated)
  assert np.all(samples.lengths == NEW)

  # (c) The cached path's log-probs equal the full forward's at each generated token.
  predicting = logits[:, PROMPT_LEN - 1 : PROMPT_LEN + NEW - 1]
  expected = np.take_along_axis(_log_softmax(predicting), samples.tokens[..., None], -1)[..., 0]
  np.testing.assert_allclose(samples.logprobs, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", SCALED)
def test_ignoring_the_rope_scaling_would_be_caught(reference, name):
  """The parity above can fail: the same weights with plain RoPE are far from transformers."""
  path, _, tokens, valid, positions, hf_logits = reference(name)
  config, _, params = hf.init_from_hf(path)
  # Plain llama31 and llama_linear share one compiled forward; plain qwen2_yarn is qwen2_untied.
  plain = dataclasses.replace(config, rope_scaling=None)
  graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(plain, rngs=nnx.Rngs(0))))[0]
  logits = np.asarray(_forward(nnx.merge(graphdef, params), tokens, positions, valid))
  assert np.max(np.abs(logits[valid] - hf_logits[valid])) > 100 * ATOL
