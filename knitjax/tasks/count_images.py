"""Synthetic image task: count the coloured shapes in a small picture (answer 0-9).

Each example is a 16x16 RGB uint8 image on a dark, slightly noisy background, divided into a 4x4
grid of 4x4-pixel cells. ``count`` cells (uniform in 0..9) each hold one shape: a 2x2 square, a
3x3 square, a 3x3 plus or a 3x3 ring, in one of seven saturated colours, inside the first three
rows and columns of its cell (2x2 squares at a random offset there). The last row and column of
every cell stay background, so shapes never touch and the count is the number of
occupied cells and every image has exactly one right answer.

Prompt: ``BOS`` then ``image_tokens`` placeholders ``@`` (replaced by the image's patch features in
the VLM; one per patch of the vision encoder) then ``how many?``. Answer: the count as one digit.
Every count occurs equally often, so any constant answer scores 0.10: the policy has to look.

Everything is generated with NumPy from a data seed, so the examples (and their images) are the
same on every run and host.
"""

import numpy as np

from knitjax.tasks.prompts import Prompt, PromptSource
from knitjax.tasks.tokenizer import CharTokenizer, split_at_eos

IMAGE_PLACEHOLDER = "@"
QUESTION = "how many?"
ALPHABET = IMAGE_PLACEHOLDER + "0123456789 howmany?"
IMAGE_SIZE = 16
GRID = 4  # cells per side
CELL = IMAGE_SIZE // GRID
MAX_COUNT = 9
CLASSES = ("count",)

COLOURS = np.array(
  [
    [230, 40, 40],  # red
    [40, 200, 60],  # green
    [50, 90, 240],  # blue
    [240, 220, 40],  # yellow
    [40, 220, 230],  # cyan
    [220, 50, 220],  # magenta
    [240, 240, 240],  # white
  ],
  np.uint8,
)
# Binary masks of the shapes; all fit in a cell's first 3x3 pixels.
SHAPES = {
  "square2": np.ones((2, 2), bool),
  "square3": np.ones((3, 3), bool),
  "plus": np.array([[0, 1, 0], [1, 1, 1], [0, 1, 0]], bool),
  "ring": np.array([[1, 1, 1], [1, 0, 1], [1, 1, 1]], bool),
}
_SHAPE_NAMES = tuple(SHAPES)


def make_tokenizer() -> CharTokenizer:
  """The task's tokenizer (vocab_size 23); the placeholder ``@`` has id 3."""
  return CharTokenizer(ALPHABET)


def image_token_id(tokenizer: CharTokenizer) -> int:
  """The id of the image placeholder token."""
  return tokenizer.encode(IMAGE_PLACEHOLDER, bos=False)[0]


def draw(count: int, rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[int, int]]]:
  """Draws an image with ``count`` shapes; returns (uint8 [16, 16, 3], occupied cells)."""
  if not 0 <= count <= MAX_COUNT:
    raise ValueError(f"count must be in [0, {MAX_COUNT}], got {count}.")
  image = rng.integers(0, 40, (IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.uint8)
  cells = rng.choice(GRID * GRID, size=count, replace=False)
  placed = []
  for cell in sorted(int(c) for c in cells):
    row, col = divmod(cell, GRID)
    mask = SHAPES[_SHAPE_NAMES[rng.integers(len(SHAPES))]]
    h, w = mask.shape
    # The cell's last row and column stay background: a gap between neighbouring shapes.
    y = row * CELL + int(rng.integers(CELL - h))
    x = col * CELL + int(rng.integers(CELL - w))
    colour = COLOURS[rng.integers(len(COLOURS))]
    image[y : y + h, x : x + w][mask] = colour
    placed.append((row, col))
  return image, placed


def make_examples(
  tokenizer: CharTokenizer, *, num_examples: int = 1000, image_tokens: int = 16, data_seed: int = 0
) -> list[Prompt]:
  """Returns ``num_examples`` prompts; example ``i`` has count ``i % 10`` and its own image.

  Args:
    tokenizer: the task's tokenizer.
    num_examples: how many distinct examples (images).
    image_tokens: placeholders per prompt: the vision encoder's patches per image.
    data_seed: seed of the images (the stream's shuffle seed is separate).
  """
  if num_examples < 1 or image_tokens < 1:
    raise ValueError(
      f"num_examples ({num_examples}) and image_tokens ({image_tokens}) must both be >= 1."
    )
  text = IMAGE_PLACEHOLDER * image_tokens + QUESTION
  tokens = np.asarray(tokenizer.encode(text), np.int32)
  examples = []
  for i in range(num_examples):
    count = i % (MAX_COUNT + 1)
    image, _ = draw(count, np.random.default_rng([data_seed, i]))
    image.setflags(write=False)
    examples.append(
      Prompt(prompt_id=i, cls="count", text=text, tokens=tokens, answer=str(count), image=image)
    )
  return examples


def make_source(
  *,
  seed: int,
  cls: str = "count",
  shuffle: bool = True,
  num_examples: int = 1000,
  image_tokens: int = 16,
  data_seed: int = 0,
) -> tuple[PromptSource, CharTokenizer]:
  """Returns (an endless PromptSource over the examples, the tokenizer)."""
  if cls not in CLASSES:
    raise ValueError(f"unknown count_images class {cls!r}; choose one of: {', '.join(CLASSES)}.")
  tokenizer = make_tokenizer()
  examples = make_examples(
    tokenizer, num_examples=num_examples, image_tokens=image_tokens, data_seed=data_seed
  )
  return PromptSource(examples, seed=seed, shuffle=shuffle), tokenizer


def exact_reward(prompt: Prompt, completion_ids: np.ndarray, tokenizer: CharTokenizer) -> float:
  """1.0 when the completion is exactly the count followed by EOS, else 0.0."""
  body, has_eos = split_at_eos(completion_ids, tokenizer.eos_id)
  return float(has_eos and body.tolist() == tokenizer.encode(prompt.answer, bos=False))
