"""The config sections of how the policy trains: optimizer, loss, critic, layout, vlm.

Each is a frozen, keyword-only dataclass built by ``config_fields.build_section`` and validated on
its own in ``__post_init__`` (one sentence naming the field and what is accepted); a field that can
switch its feature off declares that value beside it (``config_fields.setting``). Checks that span
sections (a critic's weight with the loss's advantage) are in `knitjax.config`.
"""

from __future__ import annotations

import dataclasses

from knitjax.config_fields import MAX_SAMPLES, MAX_STEPS, MAX_TOKENS, one_of, positive, setting
from knitjax.train.kl import KL_ESTIMATORS
from knitjax.train.logprobs import DEFAULT_CHUNK as DEFAULT_LOGPROB_CHUNK
from knitjax.train.losses import AGGREGATIONS, KL_PENALTIES, OBJECTIVES
from knitjax.train.packing import PACKING_MODES
from knitjax.train.prompt_sharing import PROMPT_SHARING_MODES
from knitjax.train.ratios import RATIO_LEVELS
from knitjax.train.step_advantages import ADVANTAGES


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
  """AdamW with warmup and global-norm clipping (`knitjax.train.optimizer`)."""

  lr: float = 1e-3
  # Optimizer updates (versions), not train steps.
  warmup_steps: int = setting(10, off=0, meaning="no warmup")
  weight_decay: float = setting(0.0, off=0.0, meaning="no decay")
  b1: float = 0.9
  b2: float = 0.99
  grad_clip: float = setting(1.0, off=0.0, meaning="no clipping")

  def __post_init__(self):
    s = OptimizerConfig
    positive("config.optimizer.lr", self.lr)
    if self.lr > 1.0:  # Adam moves every parameter by about lr per step
      raise ValueError(
        f"config.optimizer.lr={self.lr!r} is not accepted; it must be at most 1 (Adam moves each "
        "parameter by about lr per step)."
      )
    positive(
      "config.optimizer.warmup_steps",
      self.warmup_steps,
      allow_zero=True,
      at_most=MAX_STEPS,
      section=s,
    )
    positive("config.optimizer.grad_clip", self.grad_clip, allow_zero=True, section=s)
    positive("config.optimizer.weight_decay", self.weight_decay, allow_zero=True, section=s)
    if self.lr * self.weight_decay >= 1.0:
      raise ValueError(
        f"config.optimizer.weight_decay={self.weight_decay!r} is not accepted with "
        f"config.optimizer.lr={self.lr!r}; decoupled decay scales each parameter by "
        "1 - lr * weight_decay per step, which must stay above 0."
      )
    for name in ("b1", "b2"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(
          f"config.optimizer.{name}={getattr(self, name)!r} is not accepted; it must be in [0, 1)."
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
  """The RL objective: advantages, ratio, clipping, KL and entropy (docs/algorithms.md)."""

  advantage: str = "grpo"  # group estimators "grpo", "drgrpo", "rloo"; "gae": PPO with a critic
  eps_low: float = 0.2
  eps_high: float = 0.2
  aggregation: str = "token_mean"  # see docs/algorithms.md for the loss menu
  objective: str = "ppo"  # "cispo": clipped stop-gradient IS weights (MiniMax-M1)
  ratio_level: str = "token"  # "sequence": GSPO, "sequence_token": GSPO-token
  tis_cap: float = setting(0.0, off=0.0, meaning="no truncated importance sampling")
  eps_c: float = setting(0.0, off=0.0, meaning="no dual clip")  # dual-clip constant (> 1)
  kl_coef: float = setting(0.0, off=0.0, meaning="no KL term")
  kl_estimator: str = "k3"  # "k1", "k2", "k3" (Schulman 2020)
  # Clamp each token's KL estimate to [-kl_clamp, kl_clamp].
  kl_clamp: float = setting(0.0, off=0.0, meaning="no clamp")
  # "loss": kl_coef * KL is a loss term; "reward": it is subtracted from the rewards (per token
  # with gae, summed per sequence before the group estimators), computed in the step.
  kl_penalty: str = "loss"
  entropy_coef: float = setting(0.0, off=0.0, meaning="no entropy term")
  whiten_advantages: bool = True
  # The KL reference policy's stored dtype: "bfloat16" halves its memory (its forward computes
  # in the model's dtype either way); "float32" keeps the initial params exactly.
  reference_dtype: str = "float32"

  def __post_init__(self):
    s = LossConfig
    one_of("config.loss.reference_dtype", self.reference_dtype, ("float32", "bfloat16"))
    positive("config.loss.tis_cap", self.tis_cap, allow_zero=True, section=s)
    positive("config.loss.kl_coef", self.kl_coef, allow_zero=True, section=s)
    positive("config.loss.eps_low", self.eps_low, allow_zero=True)
    if not self.eps_low < 1.0:
      raise ValueError(
        f"config.loss.eps_low={self.eps_low!r} is not accepted; it must be in [0, 1)."
      )
    positive("config.loss.eps_high", self.eps_high, allow_zero=True)
    one_of("config.loss.advantage", self.advantage, ADVANTAGES)
    one_of("config.loss.aggregation", self.aggregation, AGGREGATIONS)
    one_of("config.loss.objective", self.objective, OBJECTIVES)
    one_of("config.loss.ratio_level", self.ratio_level, RATIO_LEVELS)
    one_of("config.loss.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
    one_of("config.loss.kl_penalty", self.kl_penalty, KL_PENALTIES)
    if self.kl_penalty == "reward" and not self.kl_coef > 0:
      raise ValueError(
        "config.loss.kl_penalty='reward' is not accepted with config.loss.kl_coef=0; set "
        "kl_coef > 0 or kl_penalty='loss'."
      )
    if not isinstance(self.whiten_advantages, bool):
      raise ValueError(
        f"config.loss.whiten_advantages={self.whiten_advantages!r} is not accepted; use True "
        "or False."
      )
    positive("config.loss.kl_clamp", self.kl_clamp, allow_zero=True, section=s)
    if not (self.eps_c == 0 or self.eps_c > 1.0):
      raise ValueError(
        f"config.loss.eps_c={self.eps_c!r} is not accepted; it must be 0 (off) or > 1."
      )
    if self.tis_cap and not self.tis_cap >= 1.0 + self.eps_high:
      raise ValueError(
        f"config.loss.tis_cap={self.tis_cap!r} is not accepted; it must be 0 (off) or >= 1 + "
        f"config.loss.eps_high = {1.0 + self.eps_high}."
      )
    if self.objective == "cispo":
      for name in ("tis_cap", "eps_c"):
        if getattr(self, name):
          raise ValueError(
            f"config.loss.{name}={getattr(self, name)!r} is not accepted with "
            "config.loss.objective='cispo'; it applies to objective 'ppo' only, set it to 0."
          )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CriticConfig:
  """PPO's critic (loss.advantage "gae"; docs/algorithms.md): a value head on the policy's trunk."""

  gamma: float = 1.0
  gae_lambda: float = 1.0  # 1: A_t = R - V(s_t) with a terminal reward, unbiased by the critic
  # 0 with advantage "gae" is refused: the critic would never train.
  value_coef: float = setting(0.1, off=0.0, meaning="no value loss")
  # PPO2's clipped value loss around the old values.
  value_clip: float = setting(0.2, off=0.0, meaning="the value loss unclipped")

  def __post_init__(self):
    for name in ("gamma", "gae_lambda"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(
          f"config.critic.{name}={getattr(self, name)!r} is not accepted; it must be in [0, 1]."
        )
    positive("config.critic.value_coef", self.value_coef, allow_zero=True, section=CriticConfig)
    positive("config.critic.value_clip", self.value_clip, allow_zero=True, section=CriticConfig)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayoutConfig:
  """How a mini-batch's rows become device batches: micro-batches, padded or packed rows, shared
  prompts, log-prob chunks."""

  micro_batches: int = 1
  # Packing (knitjax.train.packing): "pack" puts several rows of a mini-batch into each sequence
  # of pack_len tokens (first-fit decreasing, segment ids) instead of one padded row each.
  packing: str = setting("off", off="off", meaning="one padded row a sequence")
  # Tokens per packed sequence.
  pack_len: int = setting(0, off=0, meaning="the padded row length, prompt + response")
  pack_buckets: int = 1  # rows sorted by length into this many buckets, each packed alone
  # Shared prompts (knitjax.train.prompt_sharing): "group" lays a group's prompt out once, followed
  # by its responses (a tree mask: each response sees the prompt and itself), so the backbone
  # runs P + G R tokens a group instead of G (P + R), with the padded layout's exact gradients;
  # with packing "pack" whole groups are packed into pack_len sequences. "prefix" runs each
  # group's prompt once per mini-batch and keeps a row per response, which continues the prompt's
  # keys and values in any micro-batch (knitjax.train.prefix): for groups too long for one row.
  # "auto": "prefix" where it applies (a text policy, padded rows, one trainer process, G > 1, and
  # attention that is not a fused GPU/TPU kernel), else "off" (docs/prompt_sharing.md, the rule).
  prompt_sharing: str = setting("auto", off="off", meaning="a row each, its prompt its own")
  # Log-probs and entropies `logprob_chunk` positions at a time from the hidden states
  # (knitjax.train.logprobs), so the [rows, T, V] float32 logits never exist at once.
  logprob_chunk: int = setting(
    DEFAULT_LOGPROB_CHUNK, off=0, meaning="the plain path: whole logits, no chunks"
  )

  def __post_init__(self):
    positive("config.layout.micro_batches", self.micro_batches, at_most=MAX_SAMPLES)
    chunk = self.logprob_chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
      raise ValueError(
        f"config.layout.logprob_chunk={chunk!r} is not accepted; it must be an integer >= 0 "
        "(positions per log-prob chunk; 0: whole logits)."
      )
    one_of("config.layout.packing", self.packing, PACKING_MODES)
    positive(
      "config.layout.pack_len",
      self.pack_len,
      allow_zero=True,
      at_most=MAX_TOKENS,
      section=LayoutConfig,
    )
    positive("config.layout.pack_buckets", self.pack_buckets, at_most=MAX_SAMPLES)
    one_of("config.layout.prompt_sharing", self.prompt_sharing, PROMPT_SHARING_MODES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VlmConfig:
  """Training a VLM (config.vision set): multimodal encoding deduplication (docs/multimodal.md)."""

  # Encode each unique image once per mini-batch, its gradient accumulated across micro-batches.
  encoder_dedup: bool = setting(True, off=False, meaning="every row encodes its own images")
  remat_encoder: bool = False  # dedup: recompute the encoder in its backward


TRAIN_SECTIONS = {
  "optimizer": OptimizerConfig,
  "loss": LossConfig,
  "critic": CriticConfig,
  "layout": LayoutConfig,
  "vlm": VlmConfig,
}
