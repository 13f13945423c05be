"""Greedy chat with a checkpoint through knitjax's own sampler.

  python -m knitjax.chat                                   # the five demo prompts, SmolLM2-135M
  python -m knitjax.chat --init_from=Qwen/Qwen2.5-0.5B-Instruct "What is 7 * 8?"

``--init_from`` takes what ``config.init_from`` takes (a folder, a Hub id, a ``.gguf`` file, or
``gguf:smollm2-135m-instruct``, the default). Prompts are rendered with the checkpoint's chat
template and answered greedily; the output is a Markdown table (docs/smollm2.md holds one).
"""

import json
import os
import sys

import numpy as np
from absl import flags

from knitjax import cli

_INIT_FROM = flags.DEFINE_string(
  "init_from", "gguf:smollm2-135m-instruct", "Checkpoint: folder, Hub id or GGUF."
)
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 32, "Tokens generated at most.")

DEMO_PROMPTS = (
  "What is 2+2?",
  "Name three primary colors.",
  "Write a haiku about the sea.",
  "What is the capital of France?",
  "Explain photosynthesis in one sentence.",
)


def _positions(folder: str) -> tuple[int, str]:
  """(the model's positions, where that comes from): ``max_position_embeddings`` of its
  config.json, or `config_fields.MAX_TOKENS` when the file names none."""
  from knitjax.config_fields import MAX_TOKENS
  from knitjax.models.hf_config import CONFIG_FILE, _read_json

  path = os.path.join(folder, CONFIG_FILE)
  value = _read_json(path).get("max_position_embeddings")
  if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
    return value, f"max_position_embeddings in {path}"
  return MAX_TOKENS, "knitjax's bound on a sequence"


def check_budget(folder: str, prompt_lengths: list[int], max_new_tokens: int) -> None:
  """Refuses, in one sentence with the limit, a budget the model's positions cannot hold.

  Checked before the model is loaded or anything is allocated: a KV cache for
  ``--max_new_tokens=1000000000``, or the prefill of a 25,000-token prompt, would run for minutes
  before failing.
  """
  limit, source = _positions(folder)
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
    raise ValueError(f"max_new_tokens={max_new_tokens!r} is not accepted; it must be an integer.")
  if not 1 <= max_new_tokens <= limit - 1:
    raise ValueError(
      f"max_new_tokens={max_new_tokens} is not accepted; it must be in [1, {limit - 1}]: the "
      f"model has {limit} positions ({source}), one at least for the prompt."
    )
  longest = max(prompt_lengths, default=0)
  if longest + max_new_tokens > limit:
    raise ValueError(
      f"a prompt of {longest} tokens and max_new_tokens={max_new_tokens} pass the model's {limit} "
      f"positions ({source}); shorten the prompt or lower max_new_tokens."
    )


def greedy_chat(
  folder: str, prompts: list[list[int]], *, max_new_tokens: int = 32, model=None
) -> list[list[int]]:
  """Greedy continuations (ending with EOS when produced) by knitjax's `Sampler`
  (`sample_chat` at temperature 0)."""
  return sample_chat(folder, prompts, max_new_tokens=max_new_tokens, temperature=0.0, model=model)


def sample_chat(
  folder: str,
  prompts: list[list[int]],
  *,
  max_new_tokens: int = 32,
  temperature: float = 0.0,
  seed: int = 0,
  model=None,
) -> list[list[int]]:
  """Continuations (ending with EOS when produced) by knitjax's `Sampler`, the prompts
  left-padded in one batch.

  Args:
    folder: a Hugging Face checkpoint folder with its tokenizer files.
    prompts: token ids of each prompt (e.g. `HFTokenizer.apply_chat_template(..., tokenize=True)`).
    max_new_tokens: generation budget.
    temperature: 0 for greedy; else sampling at this temperature with ``jax.random.key(seed)``.
    model: ``(mesh, graphdef, params)`` to reuse; by default the folder is loaded on one device.
  """
  import jax

  from knitjax import sharding
  from knitjax.models import hf
  from knitjax.models.hf_tokenizer import HFTokenizer
  from knitjax.rollout.sampler import Sampler, SamplingConfig
  from knitjax.train.batch import left_pad

  check_budget(folder, [len(p) for p in prompts], max_new_tokens)
  if model is None:
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    _, graphdef, params = hf.init_from_hf(folder, mesh)
  else:
    mesh, graphdef, params = model
  tok = HFTokenizer.from_folder(folder)
  width = max(map(len, prompts))
  tokens, lengths = left_pad([np.asarray(p) for p in prompts], width, tok.pad_id)
  sampler = Sampler(
    graphdef,
    mesh=mesh,
    sampling=SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature),
    eos_id=tok.eos_ids,
    pad_id=tok.pad_id,
    prompt_len=width,
  )
  samples = sampler(params, tokens, lengths, jax.random.key(seed))
  return [row[:n].tolist() for row, n in zip(samples.tokens, samples.lengths, strict=True)]


def chat_table(init_from: str, prompts, *, max_new_tokens: int = 32) -> str:
  """A Markdown table of the greedy answers of ``init_from`` to ``prompts``."""
  from knitjax.config import resolve_init_from
  from knitjax.models.hf_tokenizer import HFTokenizer
  from knitjax.tasks.gsm8k import MAX_CHARS_PER_TOKEN

  folder = resolve_init_from(init_from)
  check_budget(folder, [], max_new_tokens)
  limit, source = _positions(folder)
  for i, prompt in enumerate(prompts):
    # Before rendering and tokenizing (a 100 KB prompt went on to a 25,000-token prefill).
    if len(prompt) > limit * MAX_CHARS_PER_TOKEN:
      raise ValueError(
        f"prompt {i + 1} has {len(prompt):,} characters, more than the model's {limit} positions "
        f"({source}) can hold at {MAX_CHARS_PER_TOKEN} characters a token."
      )
  tok = HFTokenizer.from_folder(folder)
  chats = [[{"role": "user", "content": p}] for p in prompts]
  outputs = greedy_chat(
    folder,
    [tok.apply_chat_template(c, tokenize=True) for c in chats],
    max_new_tokens=max_new_tokens,
  )
  lines = [
    f"{os.path.basename(folder)}, knitjax Sampler, greedy, at most {max_new_tokens} new tokens",
    "",
    "| prompt | knitjax greedy output | tokens | stop |",
    "|---|---|---|---|",
  ]
  for prompt, ids in zip(prompts, outputs, strict=True):
    ended = bool(ids) and ids[-1] in tok.eos_ids
    text = json.dumps(tok.decode(ids), ensure_ascii=False)[1:-1].replace("|", "\\|")
    lines.append(f"| {prompt} | {text} | {len(ids)} | {'EOS' if ended else 'length'} |")
  return "\n".join(lines)


def main(argv):
  cli.quiet_libraries()
  prompts = argv[1:] or list(DEMO_PROMPTS)
  try:
    print(chat_table(_INIT_FROM.value, prompts, max_new_tokens=_MAX_NEW_TOKENS.value))
  except ValueError as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  cli.run(main, stopped=lambda how: f"stopped by {how}.")
