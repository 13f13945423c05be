"""Counting task: deterministic images whose shapes can be counted, prompt layout, reward."""

import collections

import numpy as np
import pytest

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


@pytest.mark.slow
@pytest.mark.parametrize("dedup", [True, False])
def test_count_vlm_tiny_trains_through_the_runtime(tmp_path, dedup):
  """configs/count_vlm_tiny.py:quick end to end; metrics count the images each path encodes."""
  import json

  from configs import count_vlm_tiny
  from knitjax.config import from_config_dict
  from knitjax.runtime.train import train

  c = count_vlm_tiny.get_config("quick")
  c.admission.quotas = {"count": 8}
  c.rollout.group_size = 4
  c.train.encoder_dedup = dedup
  train(from_config_dict(c), str(tmp_path))
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert r["unique_images"] == 8 and r["num_seqs"] == 32
    assert r["encoder_images_encoded"] == (8 if dedup else 32)
    assert r["encoder_backward_passes"] == (1 if dedup else 2)
    assert 0.0 <= r["reward_mean"] <= 1.0 and np.isfinite(r["loss"])
