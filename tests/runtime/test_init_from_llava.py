"""config.init_from = a LLaVA folder: the VLM trains on count_images with its own tokenizer.

The checkpoint is written by transformers itself (SigLIP + Qwen2, random init) beside a tiny
byte-level tokenizer.json whose added tokens hold "<image>" at the config's image_token_index.
"""

import json

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from configs import count_vlm_tiny
from knitjax.config import from_config_dict
from knitjax.run import train
from knitjax.runtime import builder
from knitjax.tasks import count_images

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]
PAD, EOS, IMG = 256, 258, 259  # ids after the 256 byte tokens, in SPECIALS order
CHATML = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE_SIZE, PATCH = 32, 8  # 16 patches; LLaVA's "default" strategy drops one: 15 image tokens


def _tokenizer() -> Tokenizer:
  """Byte-level BPE without merges: every byte one token, then the special tokens."""
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
  assert [tok.token_to_id(t) for t in SPECIALS] == [PAD, 257, EOS, IMG]
  return tok


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
  """(folder, the transformers model) of a tiny SigLIP + Qwen2 LLaVA with its tokenizer."""
  config = transformers.LlavaConfig(
    vision_config=transformers.SiglipVisionConfig(
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=2,
      num_attention_heads=4,
      image_size=IMAGE_SIZE,
      patch_size=PATCH,
    ),
    text_config=dict(
      model_type="qwen2",
      vocab_size=264,
      hidden_size=48,
      intermediate_size=64,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      tie_word_embeddings=True,
    ),
    image_token_index=IMG,
  )
  torch.manual_seed(0)
  model = transformers.LlavaForConditionalGeneration(config).eval()
  path = tmp_path_factory.mktemp("llava")
  model.save_pretrained(path)
  _tokenizer().save(str(path / "tokenizer.json"))
  tokenizer_config = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML)
  (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
  return str(path), model


def _config(path):
  c = count_vlm_tiny.get_config("quick")
  c.init_from = path
  c.admission.quotas = {"count": 4}
  c.rollout.group_size = 4
  return c


def test_llava_init_from_sets_the_vlm_and_its_image_token(llava):
  path, model = llava
  config = from_config_dict(_config(path))
  assert config.image_token == "<image>"
  v = config.vision  # the checkpoint's tower replaced count_vlm_tiny's 16x16 one
  assert (v.image_size, v.patch_size, v.d_model, v.num_image_tokens) == (32, 8, 32, 15)
  assert (config.model.vocab_size, config.model.d_model, config.model.num_layers) == (264, 48, 2)

  prompts = builder.build_prompts(config)
  prompt = prompts.sources["count"].next(1)[0]
  assert (prompt.tokens == IMG).sum() == 15
  assert prompt.text.startswith("<|im_start|>user\n" + "<image>" * 15 + "\nHow many shapes")
  assert prompt.text.endswith("<|im_start|>assistant\n")
  assert prompt.image.shape == (32, 32, 3)
  # The reward reads the checkpoint's tokenizer: the digit, then its EOS.
  digit = prompts.tokenizer.encode(prompt.answer, bos=False)
  reward = count_images.exact_reward
  assert reward(prompt, np.array([*digit, EOS, PAD]), prompts.tokenizer) == 1.0
  assert reward(prompt, np.array(digit), prompts.tokenizer) == 0.0

  # The VLM's params are the checkpoint's, not a random init.
  _, params = builder.build_model(config, builder.build_mesh(config))
  want = model.state_dict()["model.multi_modal_projector.linear_1.weight"].numpy()
  got = np.asarray(params["projector"]["fc1"]["kernel"][...])
  np.testing.assert_array_equal(got, want.T)


def test_llava_init_from_needs_the_image_task(llava):
  path, _ = llava
  c = _config(path)
  c.task = dict(name="arith", reward="arith_exact")
  c.admission.quotas = {"arith": 4}
  with pytest.raises(ValueError, match="is a LLaVA checkpoint .* accepted: count_images"):
    from_config_dict(c)


def test_llava_init_from_trains_on_count_images(llava, tmp_path):
  path, _ = llava
  train(from_config_dict(_config(path)), str(tmp_path))
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert r["unique_images"] == 4 and r["num_seqs"] == 16
    assert 0.0 <= r["reward_mean"] <= 1.0 and np.isfinite(r["loss"])
