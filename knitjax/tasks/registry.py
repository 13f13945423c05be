"""The task registry: task name -> prompt-source factory (config strings pick a task here).

Each task module (`arith`, `gsm8k`, `longtail`, `count_images`, `calc_tool`) builds on
`knitjax.tasks.prompts`; this module sits above them all, so nothing imports back. Multi-turn
tasks also give an environment (`knitjax.tasks.environment`) through :func:`make_environment`.
"""

from collections.abc import Callable

from knitjax.tasks import arith, calc_tool, count_images, gsm8k, longtail
from knitjax.tasks.environment import EnvironmentSpec
from knitjax.tasks.prompts import PromptSource
from knitjax.tasks.tokenizer import CharTokenizer

TASKS = ("arith", "gsm8k", "longtail", "count_images", "calc_tool")
# Multi-turn tasks: task name -> its environment (config.rollout.engine "multiturn").
ENVIRONMENTS: dict[str, Callable[[], EnvironmentSpec]] = {"calc_tool": calc_tool.environment}
# The reward a multi-turn task's environment gives (config.task.reward must name it).
ENVIRONMENT_REWARDS = {"calc_tool": "calc_answer"}
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
      ``shuffle``, ``num_examples``, ``image_tokens``, ``data_seed``) or ``"calc_tool"`` (kwargs:
      ``cls``, ``shuffle``).
    seed: shuffle seed of the stream.
    **task_kwargs: passed to the task's ``make_source``.
  """
  makers = {
    "arith": arith.make_source,
    "gsm8k": gsm8k.make_source,
    "longtail": longtail.make_source,
    "count_images": count_images.make_source,
    "calc_tool": calc_tool.make_source,
  }
  if task not in makers:
    raise ValueError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}.")
  try:
    return makers[task](seed=seed, **task_kwargs)
  except TypeError as e:
    raise ValueError(f"bad arguments {sorted(task_kwargs)} for task {task!r}: {e}.") from None


def make_environment(task: str) -> EnvironmentSpec:
  """The environment of multi-turn task ``task`` (a key of ``ENVIRONMENTS``)."""
  if task not in ENVIRONMENTS:
    raise ValueError(
      f"task {task!r} has no environment; multi-turn tasks: {', '.join(ENVIRONMENTS)}."
    )
  return ENVIRONMENTS[task]()
