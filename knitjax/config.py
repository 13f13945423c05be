"""Typed, validated views of the ``ml_collections.ConfigDict`` a run is given.

The ConfigDict stops here: :func:`from_config_dict` turns it into the frozen, keyword-only
section dataclasses below (each built and type-checked by ``config_fields.build_section``) and
checks the sections against each other. Errors are one sentence that names the field and what
is accepted. Library code receives these dataclasses, never the ConfigDict.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from typing import Any

from knitjax.config_checkpoint import (
  model_from_checkpoint,
  resolve_init_from,
  vision_from_checkpoint,
)
from knitjax.config_fields import (
  MAX_CPU_DEVICES,
  MAX_DEVICES,
  MAX_SAMPLES,
  MAX_STEPS,
  MAX_TOKENS,
  build_section,
  one_of,
  positive,
  to_plain,
)
from knitjax.config_sections import (
  AdmissionConfig,
  RolloutConfig,
  TaskConfig,
  TrainConfig,
)
from knitjax.models.dtypes import AUTO_DTYPE
from knitjax.models.transformer import TransformerConfig
from knitjax.models.vision import VisionConfig
from knitjax.rollout.contract import ADOPTION
from knitjax.rollout.versions import LAG_UNITS

# Choices the runtime implements; runtime sits above config, so config owns their names.
MODES = ("colocated", "disaggregated")
WEIGHT_SYNC = ("minibatch", "step")
SYNC_DTYPES = ("auto", "bfloat16", "float32")
SYNC_PUBLISH = ("async", "blocking")
STORAGE = ("in_process", "ray")
TRANSFER = ("on_demand", "centralized")

MAX_PARAM_SLOTS = 64  # versions the rollout holds at once: far above any lag bound in use


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
  """The loop: how many steps, colocated or disaggregated, logging."""

  mode: str = "colocated"
  steps: int = 100
  log_every: int = 10
  weight_sync: str = "minibatch"
  # Disaggregated weight publish: the dtype on the wire and the rollout's params ("auto":
  # bfloat16 when config.model.dtype is bfloat16, else float32, so float32 runs stay exact), and
  # whether the trainer waits for the copy ("blocking") or it completes in the background.
  sync_dtype: str = "auto"
  sync_publish: str = "async"
  max_lag_steps: float = 1.0
  # How depth capacity comes back: "step" (once a step's last mini-batch is consumed) or
  # "minibatch" (each consumed mini-batch frees its B/M groups; version-granular).
  lag_unit: str = "step"
  # Disaggregated only: the first `rollout_devices` devices form the rollout mesh (0: half);
  # a trainer of several processes trains on every device (its rollout is in Ray actors).
  rollout_devices: int = 0
  adoption: str = "new_groups"  # or "mid_generation" (partial rollout)
  param_slots: int = 2  # versions the rollout holds at once with adoption="new_groups"
  # On-demand access: mini-batches each consumer prepares ahead of its update (0: on demand in
  # the trainer's thread), and how far token balance may give way to fetching locally.
  prefetch: int = 1
  locality_slack: float = 0.5
  # Storage units: in this process, or Ray actors (needs `pip install -e '.[ray]'`); ray_address
  # "" starts or joins a local Ray, otherwise it is passed to ray.init (e.g. "auto").
  storage: str = "in_process"
  ray_address: str = ""
  # Generate in this many Ray actors (each writing to a Ray storage unit on its own node)
  # instead of in process; 0: in process. A disaggregated trainer of several processes
  # (--distributed) needs them: process 0 runs the admission index, every process trains on
  # the one global mesh and fetches its own share (knitjax.runtime.trainer_group).
  rollout_workers: int = 0
  # Ray actor deaths (rollout actors, storage units) a run survives; one more ends it.
  actor_restarts: int = 3
  # Disaggregated only: generate in this many rollout host processes instead of in process
  # (each `python -m knitjax.main --role=rollout` with the same --config and --workdir, on its
  # own machine or devices; knitjax.rollout.remote); the trainer then trains on every device.
  rollout_hosts: int = 0
  # Where the trainer listens for rollout hosts (host:port, port 0: a free one, written to
  # WORKDIR/rollout_endpoint.json); use an address on the private network between hosts.
  rollout_listen: str = "127.0.0.1:0"
  # How long the trainer waits for its rollout hosts, and a host for the trainer (seconds).
  rollout_host_wait_s: float = 600.0

  def __post_init__(self):
    one_of("config.runtime.mode", self.mode, MODES)
    one_of("config.runtime.weight_sync", self.weight_sync, WEIGHT_SYNC)
    one_of("config.runtime.sync_dtype", self.sync_dtype, SYNC_DTYPES)
    one_of("config.runtime.sync_publish", self.sync_publish, SYNC_PUBLISH)
    one_of("config.runtime.lag_unit", self.lag_unit, LAG_UNITS)
    one_of("config.runtime.adoption", self.adoption, ADOPTION)
    one_of("config.runtime.storage", self.storage, STORAGE)
    positive(
      "config.runtime.rollout_workers",
      self.rollout_workers,
      allow_zero=True,
      at_most=MAX_CPU_DEVICES,
    )
    positive("config.runtime.actor_restarts", self.actor_restarts, allow_zero=True)
    positive(
      "config.runtime.rollout_devices", self.rollout_devices, allow_zero=True, at_most=MAX_DEVICES
    )
    positive(
      "config.runtime.rollout_hosts", self.rollout_hosts, allow_zero=True, at_most=MAX_CPU_DEVICES
    )
    positive("config.runtime.rollout_host_wait_s", self.rollout_host_wait_s)
    if self.rollout_hosts:
      _check_rollout_hosts(self)
    if self.param_slots < 1 + (self.adoption == "new_groups"):
      raise ValueError(
        f"config.runtime.param_slots={self.param_slots!r} is not accepted; adoption="
        f"{self.adoption!r} needs at least {1 + (self.adoption == 'new_groups')}."
      )
    # each slot holds a whole copy of the params on the rollout devices
    positive("config.runtime.param_slots", self.param_slots, at_most=MAX_PARAM_SLOTS)
    positive("config.runtime.steps", self.steps, at_most=MAX_STEPS)
    positive("config.runtime.log_every", self.log_every, at_most=MAX_STEPS)
    positive("config.runtime.max_lag_steps", self.max_lag_steps, allow_zero=True)
    positive("config.runtime.prefetch", self.prefetch, allow_zero=True, at_most=MAX_SAMPLES)
    positive("config.runtime.locality_slack", self.locality_slack, allow_zero=True)


def _check_rollout_hosts(runtime) -> None:
  """What ``runtime.rollout_hosts > 0`` needs of the other runtime fields."""
  if runtime.mode != "disaggregated":
    raise ValueError(
      f"config.runtime.rollout_hosts={runtime.rollout_hosts} needs config.runtime.mode="
      f"'disaggregated' (got {runtime.mode!r}): colocated runs generate on the train devices."
    )
  if runtime.rollout_workers or runtime.storage != "in_process":
    raise ValueError(
      "config.runtime.rollout_hosts is not accepted with rollout_workers or storage='ray': "
      "rollout hosts keep the payloads in their own storage units; choose one of them."
    )
  host, sep, port = runtime.rollout_listen.rpartition(":")
  if not sep or not host or not port.lstrip("-").isdigit():
    raise ValueError(
      f"config.runtime.rollout_listen={runtime.rollout_listen!r} is not accepted; give "
      "host:port, e.g. '127.0.0.1:0' or '10.0.0.2:7000' (port 0: a free one)."
    )
  if not 0 <= int(port) <= 65535:
    raise ValueError(
      f"config.runtime.rollout_listen={runtime.rollout_listen!r} is not accepted; its port "
      f"{int(port)} is outside 0..65535 (0: a free one)."
    )
  try:  # a name that does not resolve fails here, not when the trainer binds after its compile
    socket.getaddrinfo(host.strip("[]"), int(port), socket.AF_INET, socket.SOCK_STREAM)
  except OSError as e:
    raise ValueError(
      f"config.runtime.rollout_listen={runtime.rollout_listen!r} is not accepted; host "
      f"{host!r} does not resolve to an IPv4 address ({e.strerror or e})."
    ) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """Device mesh (data, fsdp, tensor); -1 infers one axis from the device count."""

  shape: tuple[int, ...] = (-1, 1, 1)
  cpu_devices: int = 2  # fake CPU devices when running on the CPU (0: leave JAX's default)

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
    positive("config.mesh.cpu_devices", self.cpu_devices, allow_zero=True, at_most=MAX_CPU_DEVICES)


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

  every_steps: int = 0  # 0: no evaluation while training (python -m knitjax.eval still works)
  prompts: int = 64  # held-out prompts per evaluation
  samples: int = 0  # samples per prompt at the rollout temperature for pass@k (0: greedy only)
  k: int = 1  # pass@k's k, <= samples
  reward: str = ""  # "" = config.task.reward; a prompt is solved when the reward is >= 1
  # Held-out prompts: a file for file-backed tasks; "" = the task's held-out split
  # ("generated:heldout" for "generated:train"), or for generated tasks a stream of another seed.
  path: str = ""
  max_new_tokens: int = 0  # 0 = config.rollout.max_new_tokens
  batch_prompts: int = 16  # prompts per sampler call

  def __post_init__(self):
    from knitjax.tasks.rewards import REWARDS

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
  train: TrainConfig
  admission: AdmissionConfig
  runtime: RuntimeConfig
  mesh: MeshConfig
  checkpoint: CheckpointConfig
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
  "train": TrainConfig,
  "admission": AdmissionConfig,
  "runtime": RuntimeConfig,
  "mesh": MeshConfig,
  "checkpoint": CheckpointConfig,
  "eval": EvalConfig,
  "transfer": TransferConfig,
}


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
  if vision is not None and sections["train"].packing != "off":
    raise ValueError(
      "config.train.packing='pack' is not accepted with a VLM (config.vision); its step takes "
      "padded rows: set packing 'off'."
    )
  if vision is not None and model.lora_rank:
    raise ValueError(
      f"config.model.lora_rank={model.lora_rank} is not supported for a VLM (config.vision); "
      "LoRA covers text decoders: set lora_rank=0 to fine-tune the VLM fully."
    )
  if model.lora_rank and sections["train"].advantage == "gae":
    raise ValueError(
      f"config.model.lora_rank={model.lora_rank} is not accepted with config.train.advantage="
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
  model = _with_value_head(model, sections["train"], vision)
  _check_class_budgets(sections)
  _check_micro_batches(sections)
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

  rollout, runtime, task = sections["rollout"], sections["runtime"], sections["task"]
  engine = rollout.engine
  if engine == "auto" and task.name in ENVIRONMENTS:
    engine = "multiturn"
  elif engine == "auto":
    text_disagg = runtime.mode == "disaggregated" and vision is None
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
  model: TransformerConfig, train: TrainConfig, vision: VisionConfig | None
) -> TransformerConfig:
  """The policy model, with a critic head when the advantage is "gae" (text models only)."""
  in_step = train.advantage == "gae" or train.kl_penalty == "reward"
  if vision is not None and in_step:
    raise ValueError(
      f"config.train.advantage={train.advantage!r} with kl_penalty={train.kl_penalty!r} is not "
      "accepted with a VLM (config.vision); its step takes host advantages only: use advantage "
      "'grpo', 'drgrpo' or 'rloo' with kl_penalty 'loss'."
    )
  return dataclasses.replace(model, value_head=train.advantage == "gae")


def _check_class_budgets(sections: dict) -> None:
  budgets, quotas = sections["rollout"].class_max_new_tokens, sections["admission"].quotas
  unknown = sorted(set(budgets) - set(quotas))
  if unknown:
    raise ValueError(
      f"config.rollout.class_max_new_tokens names {unknown}, which are not quota classes "
      f"{sorted(quotas)}."
    )


def _check_micro_batches(sections: dict) -> None:
  a, r, t = sections["admission"], sections["rollout"], sections["train"]
  rows = a.groups_per_step // a.minibatches * r.group_size
  if rows % t.micro_batches:
    raise ValueError(
      f"config.train.micro_batches={t.micro_batches} does not divide a mini-batch of {rows} "
      f"sequences (config.admission.quotas / minibatches x config.rollout.group_size)."
    )
