"""Counting task: deterministic images whose shapes can be counted, prompt layout, reward."""

import collections

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from knitjax.models.hf_tokenizer import HFTokenizer
from knitjax.tasks import count_images
from knitjax.tasks.registry import make_prompt_source
from knitjax.tasks.rewards import get_reward_fn


def _components(image: np.ndarray) -> int:
  """Connected components (4-neighbourhood) of shape pixels: any channel above the background."""
  fg = image.max(axis=-1) >= 100
  seen = np.zeros_like(fg)
  n = 0
  for start in zip(*np.nonzero(fg), strict=True):
    if seen[start]:
      continue
    n += 1
    queue = collections.deque([start])
    seen[start] = True
    while queue:
      y, x = queue.popleft()
      for dy, dx in ((1, 0), (-1, 0), (0, 1), (0, -1)):
        q = (y + dy, x + dx)
        if 0 <= q[0] < fg.shape[0] and 0 <= q[1] < fg.shape[1] and fg[q] and not seen[q]:
          seen[q] = True
          queue.append(q)
  return n


@pytest.fixture(scope="module")
def examples():
  return count_images.make_examples(count_images.make_tokenizer(), num_examples=200)


def test_every_image_shows_exactly_its_count_of_separate_shapes(examples):
  for ex in examples:
    assert ex.image.shape == (16, 16, 3) and ex.image.dtype == np.uint8
    assert _components(ex.image) == int(ex.answer)
    # One shape per occupied 4x4 cell (the cells line up with the encoder's patches).
    cells = ex.image.reshape(4, 4, 4, 4, 3).max(axis=(1, 3, 4)) >= 100
    assert cells.sum() == int(ex.answer)


def test_examples_are_deterministic_balanced_and_distinct(examples):
  again = count_images.make_examples(count_images.make_tokenizer(), num_examples=200)
  assert all(np.array_equal(a.image, b.image) for a, b in zip(examples, again, strict=True))
  assert collections.Counter(e.answer for e in examples) == {str(c): 20 for c in range(10)}
  assert len({e.image.tobytes() for e in examples}) == 200
  other = count_images.make_examples(count_images.make_tokenizer(), num_examples=5, data_seed=1)
  assert not np.array_equal(other[3].image, examples[3].image)


def test_prompt_layout(examples):
  tok = count_images.make_tokenizer()
  image_id = count_images.image_token_id(tok)
  assert image_id == 3 and tok.vocab_size == 23
  tokens = examples[0].tokens
  assert tokens[0] == tok.bos_id
  np.testing.assert_array_equal(tokens[1:17], [image_id] * 16)
  assert tok.decode(tokens[17:]) == "how many?"
  assert image_id not in tokens[17:]
  wider = count_images.make_examples(tok, num_examples=1, image_tokens=64)
  assert (wider[0].tokens == image_id).sum() == 64


def test_reward_needs_the_right_digit_then_eos(examples):
  tok = count_images.make_tokenizer()
  reward = get_reward_fn("count_exact")
  ex = examples[7]  # count 7
  digit = tok.encode("7", bos=False)[0]
  wrong = tok.encode("6", bos=False)[0]
  assert reward(ex, np.array([digit, tok.eos_id]), tok) == 1.0
  assert reward(ex, np.array([digit, tok.eos_id, tok.pad_id, tok.pad_id]), tok) == 1.0
  assert reward(ex, np.array([digit]), tok) == 0.0  # no EOS
  assert reward(ex, np.array([wrong, tok.eos_id]), tok) == 0.0
  assert reward(ex, np.array([digit, digit, tok.eos_id]), tok) == 0.0


def test_registered_as_a_task():
  source, tok = make_prompt_source("count_images", seed=0, num_examples=30, image_tokens=16)
  prompts = source.next(40)
  assert {p.cls for p in prompts} == {"count"}
  assert all(p.image is not None for p in prompts)
  assert tok.alphabet == count_images.ALPHABET
  with pytest.raises(ValueError, match="count_images class"):
    make_prompt_source("count_images", seed=0, cls="sum")


@pytest.mark.parametrize("dedup", [True, False])
def test_count_vlm_tiny_trains_through_the_runtime(tmp_path, dedup):
  """configs/count_vlm_tiny.py:quick end to end; metrics count the images each path encodes."""
  import json

  from configs import count_vlm_tiny
  from knitjax.config import from_config_dict
  from knitjax.run import train

  c = count_vlm_tiny.get_config("quick")
  c.admission.quotas = {"count": 8}
  c.rollout.group_size = 4
  c.vlm.encoder_dedup = dedup
  train(from_config_dict(c), str(tmp_path))
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert r["unique_images"] == 8 and r["num_seqs"] == 32
    assert r["encoder_images_encoded"] == (8 if dedup else 32)
    assert r["encoder_backward_passes"] == (1 if dedup else 2)
    assert 0.0 <= r["reward_mean"] <= 1.0 and np.isfinite(r["loss"])


# ---------------------------------------------------------------------------------------------
# A Hugging Face tokenizer (a LLaVA checkpoint's): its image token, chat template and stop ids.

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]
PAD, EOS, IMG = 256, 258, 259  # after the 256 byte tokens, in SPECIALS order
CHATML = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _hf_tokenizer(chat_template=CHATML) -> HFTokenizer:
  """Byte-level BPE without merges (every byte one token) plus ChatML's and LLaVA's tokens."""
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
  return HFTokenizer(
    tok,
    special_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    eos_ids=[EOS, PAD],  # two stop ids, as Qwen's generation_config gives
    pad_id=PAD,
    chat_template=chat_template,
  )


def _hf_examples(tok, **kwargs):
  kwargs = {"image_token": "<image>", "image_tokens": 15, "num_examples": 20, **kwargs}
  return count_images.make_examples(tok, **kwargs)


def test_hf_chat_prompt_repeats_the_checkpoints_image_token():
  tok = _hf_tokenizer()
  ex = _hf_examples(tok, system_prompt="Count carefully.")[3]
  want = (
    "<|im_start|>system\nCount carefully.<|im_end|>\n<|im_start|>user\n"
    + "<image>" * 15
    + "\n"
    + count_images.HF_QUESTION
    + "<|im_end|>\n<|im_start|>assistant\n"
  )
  assert ex.text == want
  np.testing.assert_array_equal(ex.tokens, tok.encode(want, bos=False))
  assert (ex.tokens == IMG).sum() == 15 and ex.answer == "3"
  plain = _hf_examples(_hf_tokenizer(chat_template=None))[0]  # no template: plain text
  assert plain.text == "<image>" * 15 + "\n" + count_images.HF_QUESTION
  assert (plain.tokens == IMG).sum() == 15 and plain.tokens[0] == IMG
  assert (_hf_examples(tok, chat=False)[0].tokens == IMG).sum() == 15


def test_hf_prompt_errors_are_one_sentence():
  tok = _hf_tokenizer()
  with pytest.raises(ValueError, match="needs image_token"):
    count_images.make_examples(tok, num_examples=1)
  with pytest.raises(ValueError, match="is 6 tokens .* must be one token"):
    _hf_examples(tok, image_token="<image")
  with pytest.raises(ValueError, match="holds 16 image tokens '<image>' .*image_tokens=15"):
    _hf_examples(tok, system_prompt="Look at <image>.")
  with pytest.raises(ValueError, match="chat=True needs a tokenizer with a chat template"):
    _hf_examples(_hf_tokenizer(chat_template=None), chat=True)
  with pytest.raises(ValueError, match="needs chat prompts"):
    _hf_examples(tok, chat=False, system_prompt="Count.")


def test_images_upscale_to_the_checkpoints_size_by_nearest_neighbour():
  small = count_images.make_examples(count_images.make_tokenizer(), num_examples=10)
  for size in (32, 30, 224, 384):
    big = _hf_examples(_hf_tokenizer(), num_examples=10, image_size=size)
    scale = size // 16
    for a, b in zip(small, big, strict=True):
      assert b.image.shape == (size, size, 3) and b.image.dtype == np.uint8
      np.testing.assert_array_equal(b.image[: 16 * scale : scale, : 16 * scale : scale], a.image)
      assert not b.image[16 * scale :].any() and not b.image[:, 16 * scale :].any()
      assert _components(b.image) == int(b.answer)
  with pytest.raises(ValueError, match="image_size must be an integer >= 16"):
    _hf_examples(_hf_tokenizer(), image_size=8)


def test_hf_reward_reads_the_digit_up_to_any_stop_id():
  tok = _hf_tokenizer()
  ex = _hf_examples(tok)[7]
  seven, six, space = (
    tok.encode("7", bos=False),
    tok.encode("6", bos=False),
    tok.encode(" ", bos=False),
  )
  reward = get_reward_fn("count_exact")
  assert reward(ex, np.array([*seven, EOS, PAD, PAD]), tok) == 1.0
  assert reward(ex, np.array([*space, *seven, PAD]), tok) == 1.0  # any stop id; space stripped
  assert reward(ex, np.array(seven), tok) == 0.0  # no stop id
  assert reward(ex, np.array([*six, EOS]), tok) == 0.0
  assert reward(ex, np.array([*seven, *seven, EOS]), tok) == 0.0
  assert reward(ex, np.array([EOS, *seven]), tok) == 0.0


def test_registered_source_takes_the_hf_tokenizer():
  tok = _hf_tokenizer()
  source, got = make_prompt_source(
    "count_images",
    seed=0,
    num_examples=10,
    image_tokens=15,
    tokenizer=tok,
    chat=None,
    system_prompt=None,
    image_token="<image>",
    image_size=32,
  )
  assert got is tok
  prompt = source.next(1)[0]
  assert (prompt.tokens == IMG).sum() == 15 and prompt.image.shape == (32, 32, 3)
