"""The config sections of what a run learns from: task, rollout, admission.

Frozen, keyword-only dataclasses, each built and type-checked by
``config_fields.build_section`` and validated on its own in ``__post_init__`` (one sentence
naming the field and what is accepted). `knitjax.config_train` holds how the policy trains
(optimizer, loss, critic, layout, vlm), `knitjax.config_run` where and how the run goes (loop,
topology, sync, pipeline), and `knitjax.config` the rest (mesh, transfer, checkpoint, eval); it
builds every section from the ConfigDict and checks them against each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from knitjax.config_fields import MAX_SAMPLES, MAX_TOKENS, one_of, positive, setting
from knitjax.rollout.sampler import MIN_TEMPERATURE
from knitjax.tasks.gsm8k import INSTRUCTION
from knitjax.transfer.admission import POLICIES

# "auto": the multi-turn rollout for tasks with an environment, else the continuous engine for
# disaggregated text runs and the batched sampler otherwise.
ENGINES = ("auto", "batched", "continuous", "multiturn")
CHAT = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
  """Which prompts and which reward function."""

  name: str = "arith"
  reward: str = "arith_exact"
  # JSONL file for file-backed tasks (gsm8k); "generated:train" for word problems.
  path: str = setting("", off="", meaning="no file: generated tasks read none")
  prompt_len: int = setting(0, off=0, meaning="the task's own maximum prompt length")
  # Prompts as chat messages through the checkpoint's chat template (init_from with a tokenizer):
  # "auto" uses the template when the tokenizer has one, "off" gives base models plain text.
  chat: str = "auto"
  system_prompt: str = setting("", off="", meaning="no system message")  # of chat prompts
  # gsm8k chat prompts: the text after the question in the user turn ("" = the question alone).
  instruction: str = INSTRUCTION

  def __post_init__(self):
    from knitjax.tasks.registry import ENVIRONMENT_REWARDS, FILE_TASKS, TASKS
    from knitjax.tasks.rewards import REWARDS

    one_of("config.task.name", self.name, tuple(TASKS))
    one_of("config.task.reward", self.reward, tuple(REWARDS))
    if self.name in ENVIRONMENT_REWARDS:  # the environment scores; the config names its reward
      one_of("config.task.reward", self.reward, (ENVIRONMENT_REWARDS[self.name],))
    one_of("config.task.chat", self.chat, CHAT)
    positive("config.task.prompt_len", self.prompt_len, allow_zero=True, at_most=MAX_TOKENS)
    if self.instruction != INSTRUCTION and self.name != "gsm8k":
      raise ValueError(
        f"config.task.instruction is set, but task {self.name!r} takes no instruction; it applies "
        "to the gsm8k task's chat prompts."
      )
    if self.name in FILE_TASKS and not self.path:
      raise ValueError(
        f"config.task.path is empty; task {self.name!r} reads its prompts from a JSONL file."
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
  """Sampling of a group of responses per prompt."""

  group_size: int = 8
  max_new_tokens: int = 4
  temperature: float = 1.0
  top_k: int = setting(0, off=0, meaning="the whole vocabulary")
  top_p: float = 1.0
  # Per-class token budgets (<= max_new_tokens); classes not named get max_new_tokens.
  class_max_new_tokens: Mapping[str, int] = dataclasses.field(default_factory=dict)
  # The continuous-batching engine (disaggregated text runs; docs/disaggregated.md). It prefills
  # each group's prompt once for its G samples, in chunks between decode iterations, and launches
  # the next engine call before the host scores and stores the groups the last one finished.
  slots: int = 64  # concurrent samples
  decode_steps: int = 8  # decode iterations per engine call, at most
  refill_groups: int = 1  # prompts each shard prefills at once (one prefill lane each)
  # Prompt tokens a lane prefills per decode iteration.
  prefill_chunk: int = setting(
    64, off=0, meaning="the whole prompt at once, stalling the live slots for it"
  )
  # What generates behind the rollout contract: "batched" (one sampler call per wave of
  # slots // group_size groups; colocated: the whole step), "continuous" (the engine),
  # "multiturn" (model and environment turns, tasks with an environment), "auto".
  engine: str = "auto"
  # DAPO's soft overlong penalty (knitjax.train.reward_shaping): the last ``overlong_buffer``
  # tokens of a sample's budget ramp its reward down by up to 1.
  overlong_buffer: int = setting(0, off=0, meaning="no overlong penalty")
  # Multi-turn rollouts: model turns per trajectory, at most, and each turn's token budget;
  # max_new_tokens bounds a whole response, environment tokens included.
  max_turns: int = 1
  turn_tokens: int = setting(0, off=0, meaning="each turn may use max_new_tokens")

  def __post_init__(self):
    positive("config.rollout.group_size", self.group_size, at_most=MAX_SAMPLES)
    positive("config.rollout.slots", self.slots, at_most=MAX_SAMPLES)
    positive("config.rollout.decode_steps", self.decode_steps, at_most=MAX_TOKENS)
    positive("config.rollout.refill_groups", self.refill_groups, at_most=MAX_SAMPLES)
    positive(
      "config.rollout.prefill_chunk", self.prefill_chunk, allow_zero=True, at_most=MAX_TOKENS
    )
    one_of("config.rollout.engine", self.engine, ENGINES)
    positive("config.rollout.max_new_tokens", self.max_new_tokens, at_most=MAX_TOKENS)
    positive("config.rollout.max_turns", self.max_turns, at_most=MAX_TOKENS)
    positive("config.rollout.turn_tokens", self.turn_tokens, allow_zero=True)
    if self.turn_tokens > self.max_new_tokens:
      raise ValueError(
        f"config.rollout.turn_tokens={self.turn_tokens!r} is not accepted; it must be in "
        f"[0, max_new_tokens={self.max_new_tokens}] (0: max_new_tokens)."
      )
    for cls, n in self.class_max_new_tokens.items():
      if not isinstance(n, int) or not 1 <= n <= self.max_new_tokens:
        raise ValueError(
          f"config.rollout.class_max_new_tokens[{cls!r}]={n!r} is not accepted; it must be an "
          f"int in [1, max_new_tokens={self.max_new_tokens}]."
        )
    if not self.temperature >= MIN_TEMPERATURE:
      raise ValueError(
        f"config.rollout.temperature={self.temperature!r} is not accepted; it must be at least "
        f"{MIN_TEMPERATURE:.3g} (float32's smallest normal number; 0, greedy, is for evaluation "
        "only: the trainer divides the logits by it)."
      )
    positive("config.rollout.top_k", self.top_k, allow_zero=True, section=RolloutConfig)
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(
        f"config.rollout.top_p={self.top_p!r} is not accepted; it must be in (0, 1]."
      )
    positive("config.rollout.overlong_buffer", self.overlong_buffer, allow_zero=True)
    if self.overlong_buffer > min([self.max_new_tokens, *self.class_max_new_tokens.values()]):
      raise ValueError(
        f"config.rollout.overlong_buffer={self.overlong_buffer} is not accepted; it must be at "
        "most every token budget (max_new_tokens and each class_max_new_tokens)."
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
  """Quota spec and admission policy (see docs/admission.md)."""

  policy: str = "minibatch"
  quotas: Mapping[str, int] = dataclasses.field(default_factory=dict)
  minibatches: int = 1
  min_per_minibatch: Mapping[str, int] = dataclasses.field(default_factory=dict)
  max_per_minibatch: Mapping[str, int] = dataclasses.field(default_factory=dict)
  dynamic_sampling: bool = False

  def __post_init__(self):
    one_of("config.admission.policy", self.policy, POLICIES)
    if not self.quotas:
      raise ValueError("config.admission.quotas is empty; give groups per train step per class.")
    positive("config.admission.minibatches", self.minibatches, at_most=MAX_SAMPLES)
    for cls, q in self.quotas.items():
      positive(f"config.admission.quotas[{cls!r}]", q, at_most=MAX_SAMPLES)
    total = sum(self.quotas.values())
    if total % self.minibatches:
      raise ValueError(
        f"config.admission.quotas sum to {total} groups per step, which is not divisible by "
        f"config.admission.minibatches={self.minibatches}."
      )
    from knitjax.transfer.quota import QuotaSpec

    try:  # the per-mini-batch bounds: known classes, min <= max, satisfiable by the quotas
      QuotaSpec(
        class_quotas=dict(self.quotas),
        minibatches=self.minibatches,
        min_per_minibatch=dict(self.min_per_minibatch),
        max_per_minibatch=dict(self.max_per_minibatch),
      )
    except ValueError as e:
      msg = str(e).replace("QuotaSpec.", "config.admission.").replace("QuotaSpec:", "")
      msg = msg.replace("class_quotas", "config.admission.quotas").strip()
      raise ValueError(msg if msg.startswith("config.") else f"config.admission: {msg}") from None

  @property
  def groups_per_step(self) -> int:
    return sum(self.quotas.values())
