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

With a Hugging Face tokenizer (a LLaVA checkpoint's, ``config.init_from``) the placeholder is the
checkpoint's image token (``image_token``, e.g. ``"<image>"``) repeated ``image_tokens`` times,
followed by `HF_QUESTION`; with a chat template (``chat`` None or True) that text is the user turn
rendered with ``add_generation_prompt=True`` and encoded without added special tokens, otherwise
it is encoded as plain text with the tokenizer's special tokens. Images are then upscaled to the
checkpoint's ``image_size`` (`upscale`). The reward accepts the digit alone up to the first stop
token, whitespace aside.

Everything is generated with NumPy from a data seed, so the examples (and their images) are the
same on every run and host.
"""

import numpy as np

from knitjax.tasks.prompts import Prompt, PromptSource
from knitjax.tasks.tokenizer import CharTokenizer, split_at_eos

IMAGE_PLACEHOLDER = "@"
QUESTION = "how many?"
# The question after the image of a prompt in a Hugging Face tokenizer's vocabulary.
HF_QUESTION = "How many shapes are in the picture? Answer with one digit."
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


def upscale(image: np.ndarray, size: int) -> np.ndarray:
  """Nearest-neighbour upscale of an image to ``size`` x ``size`` (a vision encoder's input).

  Each pixel becomes a block of ``size // 16`` x ``size // 16``; the remaining rows and columns
  (``size % 16``, bottom and right) are black, so shapes keep their count and never touch.
  """
  if isinstance(size, bool) or not isinstance(size, int) or size < IMAGE_SIZE:
    raise ValueError(f"count_images image_size must be an integer >= {IMAGE_SIZE}, got {size!r}.")
  scale = size // image.shape[0]
  big = np.repeat(np.repeat(image, scale, axis=0), scale, axis=1)
  out = np.zeros((size, size, image.shape[2]), image.dtype)
  out[: big.shape[0], : big.shape[1]] = big
  return out


def _use_chat(tokenizer, chat: bool | None, system_prompt: str | None) -> bool:
  """Resolves ``chat`` (None: whether the tokenizer has a chat template) and checks the pair."""
  has_template = bool(getattr(tokenizer, "chat_template", None))
  if chat and not has_template:
    raise ValueError(
      f"chat=True needs a tokenizer with a chat template, but {tokenizer!r} has none; pass "
      "chat=False for plain-text count_images prompts."
    )
  chat = has_template if chat is None else bool(chat)
  if system_prompt is not None and not chat:
    raise ValueError(
      f"system_prompt={system_prompt[:40]!r} needs chat prompts, but chat is off for "
      f"{tokenizer!r}; drop the system prompt or use a tokenizer with a chat template."
    )
  return chat


def _prompt(
  tokenizer, *, image_tokens: int, image_token: str | None, chat, system_prompt
) -> tuple[str, np.ndarray]:
  """(text, int32 tokens) of the prompt every example shares."""
  if isinstance(tokenizer, CharTokenizer) and image_token is None:
    _use_chat(tokenizer, chat, system_prompt)  # the character tokenizer has no chat template
    text = IMAGE_PLACEHOLDER * image_tokens + QUESTION
    return text, np.asarray(tokenizer.encode(text), np.int32)
  if not isinstance(image_token, str) or not image_token:
    raise ValueError(
      f"count_images with tokenizer {tokenizer!r} needs image_token, the checkpoint's image "
      f"token text (e.g. '<image>'), got {image_token!r}."
    )
  image_ids = tokenizer.encode(image_token, bos=False)
  if len(image_ids) != 1:
    raise ValueError(
      f"image_token {image_token!r} is {len(image_ids)} tokens of {tokenizer!r}; it must be one "
      "token, the checkpoint's image token."
    )
  content = image_token * image_tokens + "\n" + HF_QUESTION
  if _use_chat(tokenizer, chat, system_prompt):
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    messages.append({"role": "user", "content": content})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tokens = np.asarray(tokenizer.encode(text, bos=False), np.int32)
  else:
    text = content
    tokens = np.asarray(tokenizer.encode(text, bos=True), np.int32)
  found = int((tokens == image_ids[0]).sum())
  if found != image_tokens:
    raise ValueError(
      f"the count_images prompt holds {found} image tokens {image_token!r} (id {image_ids[0]}), "
      f"not image_tokens={image_tokens}; the system prompt or chat template must not write it."
    )
  return text, tokens


def make_examples(
  tokenizer,
  *,
  num_examples: int = 1000,
  image_tokens: int = 16,
  data_seed: int = 0,
  image_token: str | None = None,
  chat: bool | None = None,
  system_prompt: str | None = None,
  image_size: int | None = None,
) -> list[Prompt]:
  """Returns ``num_examples`` prompts; example ``i`` has count ``i % 10`` and its own image.

  Args:
    tokenizer: the task's `CharTokenizer`, or a Hugging Face tokenizer (`HFTokenizer`).
    num_examples: how many distinct examples (images).
    image_tokens: placeholders per prompt: the vision encoder's patches per image.
    data_seed: seed of the images (the stream's shuffle seed is separate).
    image_token: with a Hugging Face tokenizer: the checkpoint's image token text.
    chat: render the prompt with the tokenizer's chat template; None: when it has one.
    system_prompt: chat prompts: the system message, or None for none.
    image_size: upscale the 16x16 images to this size (`upscale`); None: keep 16.
  """
  if num_examples < 1 or image_tokens < 1:
    raise ValueError(
      f"num_examples ({num_examples}) and image_tokens ({image_tokens}) must both be >= 1."
    )
  text, tokens = _prompt(
    tokenizer,
    image_tokens=image_tokens,
    image_token=image_token,
    chat=chat,
    system_prompt=system_prompt,
  )
  examples = []
  for i in range(num_examples):
    count = i % (MAX_COUNT + 1)
    image, _ = draw(count, np.random.default_rng([data_seed, i]))
    if image_size is not None:
      image = upscale(image, image_size)
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
  tokenizer=None,
  chat: bool | None = None,
  system_prompt: str | None = None,
  image_token: str | None = None,
  image_size: int | None = None,
) -> tuple[PromptSource, object]:
  """Returns (an endless PromptSource over the examples, the tokenizer).

  ``tokenizer`` None: the task's `CharTokenizer`; otherwise a Hugging Face tokenizer, with
  ``image_token``, ``chat``, ``system_prompt`` and ``image_size`` as in `make_examples`.
  """
  if cls not in CLASSES:
    raise ValueError(f"unknown count_images class {cls!r}; choose one of: {', '.join(CLASSES)}.")
  tokenizer = make_tokenizer() if tokenizer is None else tokenizer
  examples = make_examples(
    tokenizer,
    num_examples=num_examples,
    image_tokens=image_tokens,
    data_seed=data_seed,
    image_token=image_token,
    chat=chat,
    system_prompt=system_prompt,
    image_size=image_size,
  )
  return PromptSource(examples, seed=seed, shuffle=shuffle), tokenizer


def exact_reward(prompt: Prompt, completion_ids: np.ndarray, tokenizer) -> float:
  """1.0 when the completion is exactly the count followed by EOS, else 0.0.

  With a Hugging Face tokenizer: the text before the first of its stop ids, stripped, is the
  digit, and a stop id was produced.
  """
  if isinstance(tokenizer, CharTokenizer):
    body, has_eos = split_at_eos(completion_ids, tokenizer.eos_id)
    return float(has_eos and body.tolist() == tokenizer.encode(prompt.answer, bos=False))
  body, has_eos = split_at_eos(completion_ids, tokenizer.eos_ids)
  return float(has_eos and tokenizer.decode(body, stop_at_eos=False).strip() == prompt.answer)
