"""The config sections of what a run learns from and how: task, rollout, train, admission.

Frozen, keyword-only dataclasses, each built and type-checked by
``config_fields.build_section`` and validated on its own in ``__post_init__`` (one sentence
naming the field and what is accepted). `knitjax.config` holds the run-level sections (runtime,
mesh, transfer, checkpoint, eval), builds every section from the ConfigDict and checks them
against each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from knitjax.config_fields import MAX_SAMPLES, MAX_STEPS, MAX_TOKENS, one_of, positive
from knitjax.rollout.sampler import MIN_TEMPERATURE
from knitjax.tasks.gsm8k import INSTRUCTION
from knitjax.train.kl import KL_ESTIMATORS
from knitjax.train.logprobs import DEFAULT_CHUNK as DEFAULT_LOGPROB_CHUNK
from knitjax.train.losses import AGGREGATIONS, KL_PENALTIES, OBJECTIVES
from knitjax.train.packing import PACKING_MODES
from knitjax.train.prompt_sharing import PROMPT_SHARING_MODES
from knitjax.train.ratios import RATIO_LEVELS
from knitjax.train.step_advantages import ADVANTAGES
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
  path: str = ""  # JSONL file for file-backed tasks (gsm8k); "generated:train" for word problems
  prompt_len: int = 0  # 0: the task's own maximum prompt length
  # Prompts as chat messages through the checkpoint's chat template (init_from with a tokenizer):
  # "auto" uses the template when the tokenizer has one, "off" gives base models plain text.
  chat: str = "auto"
  system_prompt: str = ""  # the system message of chat prompts ("" = none)
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
  top_k: int = 0
  top_p: float = 1.0
  # Per-class token budgets (<= max_new_tokens); classes not named get max_new_tokens.
  class_max_new_tokens: Mapping[str, int] = dataclasses.field(default_factory=dict)
  # The continuous-batching engine (disaggregated text runs; docs/disaggregated.md). It prefills
  # each group's prompt once for its G samples, in chunks between decode iterations, and launches
  # the next engine call before the host scores and stores the groups the last one finished.
  slots: int = 64  # concurrent samples
  decode_steps: int = 8  # decode iterations per engine call, at most
  refill_groups: int = 1  # prompts each shard prefills at once (one prefill lane each)
  # Prompt tokens a lane prefills per decode iteration (0: the whole prompt at once, stalling the
  # live slots for it).
  prefill_chunk: int = 64
  # What generates behind the rollout contract: "batched" (one sampler call per wave of
  # slots // group_size groups; colocated: the whole step), "continuous" (the engine),
  # "multiturn" (model and environment turns, tasks with an environment), "auto".
  engine: str = "auto"
  # DAPO's soft overlong penalty (knitjax.train.reward_shaping): the last ``overlong_buffer``
  # tokens of a sample's budget ramp its reward down by up to 1 (0: off).
  overlong_buffer: int = 0
  # Multi-turn rollouts: model turns per trajectory, at most, and each turn's token budget
  # (0: max_new_tokens); max_new_tokens bounds a whole response, environment tokens included.
  max_turns: int = 1
  turn_tokens: int = 0

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
    positive("config.rollout.top_k", self.top_k, allow_zero=True)
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
class TrainConfig:
  """Optimizer, RL loss and micro-batching."""

  lr: float = 1e-3
  warmup_steps: int = 10  # optimizer updates (versions), not train steps
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.99
  grad_clip: float = 1.0
  micro_batches: int = 1
  advantage: str = "grpo"  # group estimators "grpo", "drgrpo", "rloo"; "gae": PPO with a critic
  eps_low: float = 0.2
  eps_high: float = 0.2
  aggregation: str = "token_mean"  # see docs/algorithms.md for the loss menu
  objective: str = "ppo"  # "cispo": clipped stop-gradient IS weights (MiniMax-M1)
  ratio_level: str = "token"  # "sequence": GSPO, "sequence_token": GSPO-token
  tis_cap: float = 0.0  # 0: off
  eps_c: float = 0.0  # dual-clip constant (> 1); 0: off
  kl_coef: float = 0.0
  kl_estimator: str = "k3"  # "k1", "k2", "k3" (Schulman 2020)
  kl_clamp: float = 0.0  # clamp each token's KL estimate to [-kl_clamp, kl_clamp]; 0: off
  # "loss": kl_coef * KL is a loss term; "reward": it is subtracted from the rewards (per token
  # with gae, summed per sequence before the group estimators), computed in the step.
  kl_penalty: str = "loss"
  entropy_coef: float = 0.0
  # PPO with a critic (advantage "gae"; docs/algorithms.md): a value head on the policy's trunk.
  gamma: float = 1.0
  gae_lambda: float = 1.0  # 1: A_t = R - V(s_t) with a terminal reward, unbiased by the critic
  value_coef: float = 0.1
  value_clip: float = 0.2  # PPO2's clipped value loss around the old values; 0: unclipped
  whiten_advantages: bool = True
  encoder_dedup: bool = True  # VLM: encode each unique image once per mini-batch
  remat_encoder: bool = False  # VLM dedup: recompute the encoder in its backward
  # The KL reference policy's stored dtype: "bfloat16" halves its memory (its forward computes
  # in the model's dtype either way); "float32" keeps the initial params exactly.
  reference_dtype: str = "float32"
  # Packing (knitjax.train.packing): "pack" puts several rows of a mini-batch into each sequence
  # of pack_len tokens (first-fit decreasing, segment ids) instead of one padded row each.
  packing: str = "off"
  pack_len: int = 0  # tokens per packed sequence; 0: the padded row length, prompt + response
  pack_buckets: int = 1  # rows sorted by length into this many buckets, each packed alone
  # Shared prompts (knitjax.train.prompt_sharing): "group" lays a group's prompt out once, followed
  # by its responses (a tree mask: each response sees the prompt and itself), so the backbone
  # runs P + G R tokens a group instead of G (P + R), with the padded layout's exact gradients;
  # with packing "pack" whole groups are packed into pack_len sequences. "off": a row each.
  prompt_sharing: str = "off"
  # Log-probs and entropies `logprob_chunk` positions at a time from the hidden states
  # (knitjax.train.logprobs), so the [rows, T, V] float32 logits never exist at once; 0: the
  # plain path (whole logits).
  logprob_chunk: int = DEFAULT_LOGPROB_CHUNK

  def __post_init__(self):
    positive("config.train.lr", self.lr)
    if self.lr > 1.0:  # Adam moves every parameter by about lr per step
      raise ValueError(
        f"config.train.lr={self.lr!r} is not accepted; it must be at most 1 (Adam moves each "
        "parameter by about lr per step)."
      )
    one_of("config.train.reference_dtype", self.reference_dtype, ("float32", "bfloat16"))
    positive("config.train.warmup_steps", self.warmup_steps, allow_zero=True, at_most=MAX_STEPS)
    positive("config.train.micro_batches", self.micro_batches, at_most=MAX_SAMPLES)
    positive("config.train.grad_clip", self.grad_clip, allow_zero=True)
    positive("config.train.tis_cap", self.tis_cap, allow_zero=True)
    positive("config.train.kl_coef", self.kl_coef, allow_zero=True)
    positive("config.train.weight_decay", self.weight_decay, allow_zero=True)
    if self.lr * self.weight_decay >= 1.0:
      raise ValueError(
        f"config.train.weight_decay={self.weight_decay!r} is not accepted with config.train.lr="
        f"{self.lr!r}; decoupled decay scales each parameter by 1 - lr * weight_decay per step, "
        "which must stay above 0."
      )
    positive("config.train.eps_low", self.eps_low, allow_zero=True)
    if not self.eps_low < 1.0:
      raise ValueError(
        f"config.train.eps_low={self.eps_low!r} is not accepted; it must be in [0, 1)."
      )
    positive("config.train.eps_high", self.eps_high, allow_zero=True)
    for name in ("b1", "b2"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(
          f"config.train.{name}={getattr(self, name)!r} is not accepted; it must be in [0, 1)."
        )
    one_of("config.train.advantage", self.advantage, ADVANTAGES)
    one_of("config.train.aggregation", self.aggregation, AGGREGATIONS)
    one_of("config.train.objective", self.objective, OBJECTIVES)
    one_of("config.train.ratio_level", self.ratio_level, RATIO_LEVELS)
    one_of("config.train.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
    one_of("config.train.kl_penalty", self.kl_penalty, KL_PENALTIES)
    if self.kl_penalty == "reward" and not self.kl_coef > 0:
      raise ValueError(
        "config.train.kl_penalty='reward' is not accepted with config.train.kl_coef=0; set "
        "kl_coef > 0 or kl_penalty='loss'."
      )
    for name in ("gamma", "gae_lambda"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(
          f"config.train.{name}={getattr(self, name)!r} is not accepted; it must be in [0, 1]."
        )
    positive("config.train.value_coef", self.value_coef, allow_zero=self.advantage != "gae")
    chunk = self.logprob_chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
      raise ValueError(
        f"config.train.logprob_chunk={chunk!r} is not accepted; it must be an integer >= 0 "
        "(positions per log-prob chunk; 0: whole logits)."
      )
    positive("config.train.value_clip", self.value_clip, allow_zero=True)
    if not isinstance(self.whiten_advantages, bool):
      raise ValueError(
        f"config.train.whiten_advantages={self.whiten_advantages!r} is not accepted; use True "
        "or False."
      )
    positive("config.train.kl_clamp", self.kl_clamp, allow_zero=True)
    if not (self.eps_c == 0 or self.eps_c > 1.0):
      raise ValueError(
        f"config.train.eps_c={self.eps_c!r} is not accepted; it must be 0 (off) or > 1."
      )
    if self.tis_cap and not self.tis_cap >= 1.0 + self.eps_high:
      raise ValueError(
        f"config.train.tis_cap={self.tis_cap!r} is not accepted; it must be 0 (off) or >= 1 + "
        f"config.train.eps_high = {1.0 + self.eps_high}."
      )
    one_of("config.train.packing", self.packing, PACKING_MODES)
    positive("config.train.pack_len", self.pack_len, allow_zero=True, at_most=MAX_TOKENS)
    positive("config.train.pack_buckets", self.pack_buckets, at_most=MAX_SAMPLES)
    one_of("config.train.prompt_sharing", self.prompt_sharing, PROMPT_SHARING_MODES)
    if self.objective == "cispo":
      for name in ("tis_cap", "eps_c"):
        if getattr(self, name):
          raise ValueError(
            f"config.train.{name}={getattr(self, name)!r} is not accepted with "
            "config.train.objective='cispo'; it applies to objective 'ppo' only, set it to 0."
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
