"""Typed, validated views of the ``ml_collections.ConfigDict`` a run is given.

The ConfigDict stops here: :func:`from_config_dict` turns it into the frozen, keyword-only
section dataclasses below (each built and type-checked by ``config_fields.build_section``) and
checks the sections against each other. Errors are one sentence that names the field and what
is accepted. Library code receives these dataclasses, never the ConfigDict.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from knitjax.config_checkpoint import (
  model_from_checkpoint,
  resolve_init_from,
  vision_from_checkpoint,
)
from knitjax.config_fields import (
  MAX_CPU_DEVICES,
  MAX_SAMPLES,
  MAX_STEPS,
  MAX_TOKENS,
  build_section,
  one_of,
  positive,
  setting,
  to_plain,
)
from knitjax.config_run import (
  RUN_SECTIONS,
  LoopConfig,
  PipelineConfig,
  SyncConfig,
  TopologyConfig,
)
from knitjax.config_sections import (
  AdmissionConfig,
  RolloutConfig,
  TaskConfig,
)
from knitjax.config_train import (
  TRAIN_SECTIONS,
  CriticConfig,
  LayoutConfig,
  LossConfig,
  OptimizerConfig,
  VlmConfig,
)
from knitjax.models.dtypes import AUTO_DTYPE
from knitjax.models.transformer import TransformerConfig
from knitjax.models.vision import VisionConfig

TRANSFER = ("on_demand", "centralized")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """Device mesh (data, fsdp, tensor); -1 infers one axis from the device count."""

  shape: tuple[int, ...] = (-1, 1, 1)
  # Fake CPU devices when running on the CPU.
  cpu_devices: int = setting(2, off=0, meaning="JAX's own device count")

  def __post_init__(self):
    if len(self.shape) != 3:
      raise ValueError(
        f"config.mesh.shape={self.shape!r} must have 3 entries (data, fsdp, tensor)."
      )
    sizes_ok = all(
      isinstance(n, int) and not isinstance(n, bool) and (n >= 1 or n == -1) for n in self.shape
    )
    if not sizes_ok or list(self.shape).count(-1) > 1:
      raise ValueError(
        f"config.mesh.shape={self.shape!r} is not accepted; give 3 ints >= 1, at most one of "
        "them -1 (inferred from the device count)."
      )
    positive(
      "config.mesh.cpu_devices",
      self.cpu_devices,
      allow_zero=True,
      at_most=MAX_CPU_DEVICES,
      section=MeshConfig,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransferConfig:
  """How the trainer gets a released mini-batch's payloads (docs/multimodal.md, "Transfer").

  ``on_demand`` (knitjax): each consumer fetches exactly its groups from their storage units,
  each unique image once per mini-batch, preparing the next mini-batch while the current one
  computes. ``centralized`` (the single-controller baseline, `knitjax.transfer.centralized`): a
  driver gathers the whole step once its last mini-batch is released, materialises every row's
  own image copy, and training starts when that is done (no prefetch). Same updates either way.
  """

  mode: str = "on_demand"

  def __post_init__(self):
    one_of("config.transfer.mode", self.mode, TRANSFER)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
  every_steps: int = 50
  keep: int = 2

  def __post_init__(self):
    positive("config.checkpoint.every_steps", self.every_steps, at_most=MAX_STEPS)
    positive("config.checkpoint.keep", self.keep, at_most=MAX_STEPS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
  """Held-out evaluation (`knitjax.runtime.evaluation`): greedy accuracy and pass@k."""

  # Train steps between evaluations (python -m knitjax.eval works either way).
  every_steps: int = setting(0, off=0, meaning="no evaluation while training")
  prompts: int = 64  # held-out prompts per evaluation
  # Samples per prompt at the rollout temperature for pass@k.
  samples: int = setting(0, off=0, meaning="greedy only")
  k: int = 1  # pass@k's k, <= samples
  # A prompt is solved when the reward is >= 1.
  reward: str = setting("", off="", meaning="config.task.reward")
  # Held-out prompts: a file for file-backed tasks; for generated tasks a stream of another seed.
  path: str = setting(
    "", off="", meaning="the task's held-out split (generated:heldout for generated:train)"
  )
  # More held-out sets, each evaluated as config.eval.path's is (config.eval.prompts of each) and
  # reported as eval_<name>_* (<name>: a generated path's split, such as heldout_phrasings for
  # generated:one_step:heldout_phrasings, or a file's name).
  extra_paths: tuple[str, ...] = setting(
    (), off=(), meaning="only the held-out set of config.eval.path"
  )
  max_new_tokens: int = setting(0, off=0, meaning="config.rollout.max_new_tokens")
  batch_prompts: int = 16  # prompts per sampler call

  def __post_init__(self):
    from knitjax.tasks import gsm8k
    from knitjax.tasks.rewards import REWARDS

    names = {}
    for i, path in enumerate(self.extra_paths):
      where = f"config.eval.extra_paths[{i}]"
      if not isinstance(path, str) or not path:
        raise ValueError(
          f"{where}={path!r} is not accepted; it must be a held-out data path (a file, or a "
          "generated split such as 'generated:one_step:heldout_phrasings')."
        )
      try:
        name = gsm8k.set_name(path)
      except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
      if name in names:
        raise ValueError(
          f"{where}={path!r} and config.eval.extra_paths[{names[name]}] would both be reported "
          f"as eval_{name}_*; give each held-out set another file or split name."
        )
      names[name] = i

    positive("config.eval.every_steps", self.every_steps, allow_zero=True, at_most=MAX_STEPS)
    positive("config.eval.prompts", self.prompts, at_most=MAX_SAMPLES)
    positive("config.eval.samples", self.samples, allow_zero=True, at_most=MAX_SAMPLES)
    positive("config.eval.k", self.k)
    positive("config.eval.max_new_tokens", self.max_new_tokens, allow_zero=True, at_most=MAX_TOKENS)
    positive("config.eval.batch_prompts", self.batch_prompts, at_most=MAX_SAMPLES)
    if self.reward:
      one_of("config.eval.reward", self.reward, tuple(REWARDS))
    if self.k > max(self.samples, 1):
      raise ValueError(
        f"config.eval.k={self.k} must be <= config.eval.samples={self.samples} (pass@k draws k "
        "of the samples; without samples only k=1, greedy, is measured)."
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """The whole run, validated."""

  seed: int
  model: TransformerConfig
  task: TaskConfig
  rollout: RolloutConfig
  admission: AdmissionConfig
  mesh: MeshConfig
  checkpoint: CheckpointConfig
  loop: LoopConfig = dataclasses.field(default_factory=LoopConfig)
  topology: TopologyConfig = dataclasses.field(default_factory=TopologyConfig)
  sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
  pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  loss: LossConfig = dataclasses.field(default_factory=LossConfig)
  critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
  layout: LayoutConfig = dataclasses.field(default_factory=LayoutConfig)
  vlm: VlmConfig = dataclasses.field(default_factory=VlmConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)
  vision: VisionConfig | None = None  # set: the policy is a VLM (knitjax.models.vlm)
  # A Hugging Face checkpoint folder (Qwen2/Qwen3/Llama, knitjax.models.hf) the policy starts
  # from: config.model then comes from its config.json (config.model may set only the fields
  # of transformer.EXECUTION_FIELDS and LoRA's: dtype, remat, scan_layers, ...).
  # A LLaVA folder (knitjax.models.hf_vision) also sets config.vision and image_token.
  init_from: str = ""
  # LLaVA init_from: the text of the checkpoint's image token (config.json image_token_index in
  # its tokenizer.json), which count_images prompts repeat once per image feature.
  image_token: str = ""


SECTIONS = {
  "task": TaskConfig,
  "rollout": RolloutConfig,
  "admission": AdmissionConfig,
  **RUN_SECTIONS,
  **TRAIN_SECTIONS,
  "mesh": MeshConfig,
  "checkpoint": CheckpointConfig,
  "eval": EvalConfig,
  "transfer": TransferConfig,
}

# The sections "train" and "runtime" were split by concept (2026-12): old name -> new name.
RENAMED = {
  **{
    f"runtime.{f}": f"{section}.{f}"
    for section, fields in (
      ("loop", ("steps", "log_every")),
      ("pipeline", ("max_lag_steps", "lag_unit", "prefetch", "locality_slack")),
      ("sync", ("adoption",)),
      (
        "topology",
        (
          "mode",
          "rollout_devices",
          "storage",
          "ray_address",
          "rollout_workers",
          "actor_restarts",
        ),
      ),
    )
    for f in fields
  },
  "runtime.weight_sync": "sync.every",
  "runtime.sync_dtype": "sync.dtype",
  "runtime.sync_publish": "sync.publish",
  "runtime.param_slots": "sync.held_versions",
  **{
    f"train.{f}": f"{section}.{f}"
    for section, cls in TRAIN_SECTIONS.items()
    for f in (x.name for x in dataclasses.fields(cls))
  },
}


# Fields that went with the feature they configured: old name -> what to use instead.
_RAY_INSTEAD = (
  "went with rollout hosts (2026-12): Ray is the one way to put the rollout on other machines "
  "(config.topology.rollout_workers, config.topology.ray_address; docs/disaggregated.md)."
)
RETIRED = {
  f"{section}.{f}": _RAY_INSTEAD
  for section in ("topology", "runtime")
  for f in ("rollout_hosts", "rollout_listen", "rollout_host_wait_s")
}


def renamed(old: str) -> str | None:
  """One sentence naming the new name of an old ``section.field`` (or ``section``), or what
  replaced a retired field; else None."""
  old = old.removeprefix("config.")
  if old in RETIRED:
    return f"config.{old} {RETIRED[old]}"
  if old in RENAMED:
    return f"config.{old} is now config.{RENAMED[old]}."
  if old in ("train", "runtime"):
    new = sorted({v.split(".")[0] for k, v in RENAMED.items() if k.startswith(old + ".")})
    return (
      f"config.{old} was split by concept into {', '.join('config.' + n for n in new)} "
      "(docs/config.md lists where each field went)."
    )
  return None


def from_config_dict(config: Mapping[str, Any]) -> Config:
  """Validates a ConfigDict (or plain dict) and returns the typed :class:`Config`.

  Raises:
    ValueError: one sentence naming the bad field and what is accepted.
  """
  config = to_plain(config)
  if not isinstance(config, Mapping):
    raise ValueError(f"the config must be a mapping of sections, got {type(config).__name__}.")
  known = {"seed", "model", "vision", "init_from", *SECTIONS}
  for key in config:
    if key in ("train", "runtime"):
      fields = config[key] if isinstance(config[key], Mapping) else {}
      named = [f"{key}.{f}" for f in fields if f"{key}.{f}" in RENAMED | RETIRED]
      raise ValueError(renamed(named[0] if named else key))
    fields = config[key] if isinstance(config[key], Mapping) else {}
    if retired := [f"{key}.{f}" for f in fields if f"{key}.{f}" in RETIRED]:
      raise ValueError(renamed(retired[0]))
    if key not in known:
      raise ValueError(f"config.{key} is not a known section; known: {', '.join(sorted(known))}.")
  for name in ("model", "vision"):  # merged with defaults below: a mapping or nothing
    value = to_plain(config.get(name))
    if value is not None and not isinstance(value, Mapping):
      raise ValueError(
        f"config.{name}={value!r:.80} is not accepted; it must be a mapping of fields."
      )
  sections = {
    name: build_section(cls, config.get(name, {}), f"config.{name}")
    for name, cls in SECTIONS.items()
  }
  init_from = config.get("init_from") or ""
  if not isinstance(init_from, str):
    raise ValueError(f"config.init_from={init_from!r} has the wrong type; expected a folder path.")
  if init_from:
    init_from = resolve_init_from(init_from)
    model = model_from_checkpoint(init_from, to_plain(config.get("model") or {}))
  else:
    # The compute dtype defaults to the backend's (bf16 on TPU/GPU, float32 on the CPU).
    model_fields = {"dtype": AUTO_DTYPE, **(config.get("model") or {})}
    model = build_section(TransformerConfig, model_fields, "config.model")
  seed = config.get("seed", 0)
  if not isinstance(seed, int) or isinstance(seed, bool):
    raise ValueError(f"config.seed={seed!r} has the wrong type; expected int.")
  vision, image_token = None, ""
  if init_from:
    vision, image_token = vision_from_checkpoint(
      init_from, to_plain(config.get("vision") or {}), model.dtype, sections["task"].name
    )
  elif config.get("vision"):
    vision_fields = {"dtype": model.dtype, **config["vision"]}  # default: the decoder's dtype
    vision = build_section(VisionConfig, vision_fields, "config.vision")
  if sections["layout"].prompt_sharing == "prefix" and (
    sections["layout"].packing != "off"
    or (vision is not None and not sections["vlm"].encoder_dedup)
  ):
    raise ValueError(
      "config.layout.prompt_sharing='prefix' takes padded rows and, with a VLM, each unique image "
      "once: it is not accepted with packing 'pack' or config.vlm.encoder_dedup off."
    )
  if vision is not None and sections["layout"].packing != "off":
    raise ValueError(
      "config.layout.packing='pack' is not accepted with a VLM (config.vision); its step takes "
      "padded rows: set packing 'off'."
    )
  if vision is not None and model.lora_rank:
    raise ValueError(
      f"config.model.lora_rank={model.lora_rank} is not supported for a VLM (config.vision); "
      "LoRA covers text decoders: set lora_rank=0 to fine-tune the VLM fully."
    )
  if model.lora_rank and sections["loss"].advantage == "gae":
    raise ValueError(
      f"config.model.lora_rank={model.lora_rank} is not accepted with config.loss.advantage="
      "'gae': LoRA trains adapters only and would freeze the critic's value head; use "
      "lora_rank=0 with gae, or a group estimator (grpo, drgrpo, rloo) with LoRA."
    )
  if init_from:
    _check_positions(init_from, sections)
  if sections["rollout"].top_k > model.vocab_size:
    raise ValueError(
      f"config.rollout.top_k={sections['rollout'].top_k} is not accepted; it must be at most the "
      f"model's vocab_size {model.vocab_size} (0: off)."
    )
  sections["rollout"] = _resolve_engine(sections, vision)
  if sections["loss"].advantage == "gae" and not sections["critic"].value_coef > 0:
    raise ValueError(
      f"config.critic.value_coef={sections['critic'].value_coef!r} is not accepted; it must be > 0 "
      "with config.loss.advantage='gae' (the critic would never train)."
    )
  model = _with_value_head(model, sections["loss"], vision)
  _check_class_budgets(sections)
  _check_eval_sets(sections)
  _check_micro_batches(sections)
  _check_group_estimator(sections)
  return Config(
    seed=seed,
    model=model,
    vision=vision,
    init_from=init_from,
    image_token=image_token,
    **sections,
  )


def _check_positions(init_from: str, sections: dict) -> None:
  """Token budgets within the checkpoint's positions (``max_position_embeddings`` of its
  config.json, or of its ``text_config`` for a VLM; nothing to check when it names none)."""
  from knitjax.models.hf_config import CONFIG_FILE, _read_json

  path = os.path.join(init_from, CONFIG_FILE)
  hf = _read_json(path)
  positions = hf.get("max_position_embeddings")
  if positions is None and isinstance(hf.get("text_config"), dict):
    positions = hf["text_config"].get("max_position_embeddings")
  if isinstance(positions, bool) or not isinstance(positions, int) or positions < 2:
    return
  prompt_len = sections["task"].prompt_len
  for name, n in (
    ("rollout.max_new_tokens", sections["rollout"].max_new_tokens),
    ("eval.max_new_tokens", sections["eval"].max_new_tokens),
  ):
    if n + max(prompt_len, 1) > positions:
      prompt = f" with config.task.prompt_len={prompt_len}" if prompt_len else ""
      raise ValueError(
        f"config.{name}={n} is not accepted{prompt}; prompt and response must fit the model's "
        f"{positions} positions (max_position_embeddings in {path})."
      )


def _resolve_engine(sections: dict, vision: VisionConfig | None) -> RolloutConfig:
  """Resolves ``rollout.engine="auto"`` and checks the rollout can run the policy."""
  from knitjax.tasks.registry import ENVIRONMENTS

  rollout, topology, task = sections["rollout"], sections["topology"], sections["task"]
  engine = rollout.engine
  if engine == "auto" and task.name in ENVIRONMENTS:
    engine = "multiturn"
  elif engine == "auto":
    text_disagg = topology.mode == "disaggregated" and vision is None
    engine = "continuous" if text_disagg else "batched"
  _check_multiturn(sections, engine)
  if vision is not None:
    if engine == "continuous":
      raise ValueError(
        "config.rollout.engine='continuous' cannot encode images; a VLM (config.vision) needs "
        "config.rollout.engine='batched' (or 'auto')."
      )
    if task.name != "count_images":
      raise ValueError(
        f"config.vision is set but config.task.name={task.name!r} has no images; accepted: "
        "count_images."
      )
  return dataclasses.replace(rollout, engine=engine)


def _check_multiturn(sections: dict, engine: str) -> None:
  """Tasks with an environment run on the multi-turn rollout, and only they do."""
  from knitjax.tasks.registry import ENVIRONMENTS

  rollout, task = sections["rollout"], sections["task"]
  if (engine == "multiturn") != (task.name in ENVIRONMENTS):
    raise ValueError(
      f"config.rollout.engine={engine!r} does not fit config.task.name={task.name!r}; "
      f"engine 'multiturn' (or 'auto') runs exactly the tasks with an environment: "
      f"{', '.join(ENVIRONMENTS)}."
    )
  if engine != "multiturn":
    if rollout.max_turns != 1 or rollout.turn_tokens:
      raise ValueError(
        "config.rollout.max_turns / turn_tokens apply to config.rollout.engine='multiturn' only; "
        "leave them at 1 / 0."
      )
    return
  refused = {
    "config.rollout.class_max_new_tokens": bool(rollout.class_max_new_tokens),
    "config.rollout.overlong_buffer": rollout.overlong_buffer > 0,
    "config.eval.every_steps": sections["eval"].every_steps > 0,
  }
  for key, set_ in refused.items():
    if set_:
      raise ValueError(
        f"{key} is not accepted with config.rollout.engine='multiturn' (not supported yet); "
        "leave it at its default."
      )


def _with_value_head(
  model: TransformerConfig, loss: LossConfig, vision: VisionConfig | None
) -> TransformerConfig:
  """The policy model, with a critic head when the advantage is "gae" (text models only)."""
  in_step = loss.advantage == "gae" or loss.kl_penalty == "reward"
  if vision is not None and in_step:
    raise ValueError(
      f"config.loss.advantage={loss.advantage!r} with kl_penalty={loss.kl_penalty!r} is not "
      "accepted with a VLM (config.vision); its step takes host advantages only: use advantage "
      "'grpo', 'drgrpo' or 'rloo' with kl_penalty 'loss'."
    )
  return dataclasses.replace(model, value_head=loss.advantage == "gae")


def _check_class_budgets(sections: dict) -> None:
  budgets, quotas = sections["rollout"].class_max_new_tokens, sections["admission"].quotas
  unknown = sorted(set(budgets) - set(quotas))
  if unknown:
    raise ValueError(
      f"config.rollout.class_max_new_tokens names {unknown}, which are not quota classes "
      f"{sorted(quotas)}."
    )


def _check_eval_sets(sections: dict) -> None:
  """More held-out sets (config.eval.extra_paths) are data paths: for the tasks that read them."""
  from knitjax.tasks.registry import FILE_TASKS

  task, extra = sections["task"].name, sections["eval"].extra_paths
  if extra and task not in FILE_TASKS:
    raise ValueError(
      f"config.eval.extra_paths={list(extra)} is not accepted with config.task.name={task!r}, "
      f"which reads no files; held-out sets are read by: {', '.join(FILE_TASKS)} (leave it empty)."
    )


def _check_group_estimator(sections: dict) -> None:
  """A group estimator compares a group's responses with each other: one response a group
  gives every advantage 0, and the run would train on nothing without a word."""
  advantage, g = sections["loss"].advantage, sections["rollout"].group_size
  if advantage != "gae" and g < 2:
    raise ValueError(
      f"config.rollout.group_size={g} gives every response an advantage of 0 under "
      f"config.loss.advantage={advantage!r}, which compares the responses of a group; give 2 "
      "or more, or loss.advantage='gae' (a critic)."
    )


def _check_micro_batches(sections: dict) -> None:
  a, r, t = sections["admission"], sections["rollout"], sections["layout"]
  rows = a.groups_per_step // a.minibatches * r.group_size
  if rows % t.micro_batches:
    raise ValueError(
      f"config.layout.micro_batches={t.micro_batches} does not divide a mini-batch of {rows} "
      f"sequences (config.admission.quotas / minibatches x config.rollout.group_size)."
    )
