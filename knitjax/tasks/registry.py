"""The task registry: task name -> prompt-source factory (config strings pick a task here).

Each task module (`arith`, `gsm8k`, `longtail`, `count_images`) builds on
`knitjax.tasks.prompts`; this module sits above them all, so nothing imports back.
"""

from knitjax.tasks import arith, count_images, gsm8k, longtail
from knitjax.tasks.prompts import PromptSource
from knitjax.tasks.tokenizer import CharTokenizer

TASKS = ("arith", "gsm8k", "longtail", "count_images")
# Tasks that read their prompts from a file (config.task.path).
FILE_TASKS = ("gsm8k",)
# Tasks whose prompts a Hugging Face tokenizer can encode (config.init_from's, with its chat
# template; count_images: a LLaVA checkpoint's); the others use their own character tokenizer.
TOKENIZER_TASKS = ("gsm8k", "count_images")


def make_prompt_source(
  task: str, *, seed: int, **task_kwargs
) -> tuple["PromptSource", CharTokenizer]:
  """Returns (PromptSource, CharTokenizer) for ``task``.

  Args:
    task: ``"arith"`` (kwargs: ``cls`` in ``"arith"``/``"sum"``, ``shuffle``) or ``"gsm8k"``
      (kwargs: ``path`` to the JSONL file, ``cls``, ``shuffle``) or ``"longtail"`` (kwargs:
      ``cls`` in ``"arith"``/``"think"``, ``shuffle``) or ``"count_images"`` (kwargs: ``cls``,
      ``shuffle``, ``num_examples``, ``image_tokens``, ``data_seed``).
    seed: shuffle seed of the stream.
    **task_kwargs: passed to the task's ``make_source``.
  """
  makers = {
    "arith": arith.make_source,
    "gsm8k": gsm8k.make_source,
    "longtail": longtail.make_source,
    "count_images": count_images.make_source,
  }
  if task not in makers:
    raise ValueError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}.")
  try:
    return makers[task](seed=seed, **task_kwargs)
  except TypeError as e:
    raise ValueError(f"bad arguments {sorted(task_kwargs)} for task {task!r}: {e}.") from None
