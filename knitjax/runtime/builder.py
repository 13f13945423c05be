"""Builds the parts of a run from a validated :class:`~knitjax.config.Config`.

Each part is constructed here and passed to the loops that use it, so the
loops themselves hold no construction logic and tests can swap parts.
"""

from __future__ import annotations

import copy
import os

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

from knitjax import sharding
from knitjax.config import Config
from knitjax.models import lora
from knitjax.models.layers import ValueHead
from knitjax.models.transformer import Transformer
from knitjax.models.vlm import VLM
from knitjax.runtime.layout_choice import build_layout, shared_spans
from knitjax.runtime.learner import Learner
from knitjax.tasks import count_images, gsm8k
from knitjax.tasks.prompts import Prompt, PromptSource
from knitjax.tasks.registry import make_prompt_source
from knitjax.tasks.streams import ClassStreams
from knitjax.tasks.tokenizer import CharTokenizer
from knitjax.train import losses, mm_step
from knitjax.train.checkpoint import Checkpointer
from knitjax.train.optimizer import make_optimizer
from knitjax.train.step import (
  StepHParams,
  TrainState,
  compile_train_step,
  init_train_state,
)
from knitjax.train.step_advantages import AdvantageConfig
from knitjax.transfer.access import RowSpec
from knitjax.transfer.admission import AdmissionIndex
from knitjax.transfer.centralized import CentralizedFeed, CentralizedPreparer
from knitjax.transfer.feed import OnDemandFeed
from knitjax.transfer.prepare import MiniBatchPreparer
from knitjax.transfer.quota import QuotaSpec


def _longest_prompt(source: PromptSource) -> int:
  """Longest prompt of one epoch, read from a copy so the stream does not advance."""
  probe = copy.copy(source)
  return max(len(p.tokens) for p in probe.next(source.num_examples))


def build_tokenizer(config: Config):
  """The checkpoint's Hugging Face tokenizer for tasks that take one (``config.init_from``; for
  count_images a LLaVA checkpoint's), else None: the task then uses its own character tokenizer."""
  from knitjax.tasks.registry import TOKENIZER_TASKS

  if not config.init_from:
    return None
  has_tokenizer = os.path.isfile(os.path.join(config.init_from, "tokenizer.json"))
  takes_one = config.task.name in TOKENIZER_TASKS and (
    config.task.name != "count_images" or config.image_token  # image prompts: LLaVA's token
  )
  if not takes_one:
    if has_tokenizer:
      # Its own character ids would mean other tokens to this model: wrong text, no error.
      raise ValueError(
        f"config.task.name={config.task.name!r} encodes prompts with its own character "
        f"tokenizer, but {config.init_from} has a tokenizer.json whose ids mean other tokens; "
        f"use a task that takes the checkpoint's tokenizer ({', '.join(TOKENIZER_TASKS)}) or a "
        "checkpoint trained on the task (knitjax's export writes no tokenizer.json)."
      )
    return None
  from knitjax.models.hf_tokenizer import HFTokenizer

  tokenizer = HFTokenizer.from_folder(config.init_from)
  tokenizer.check_fits(config.model.vocab_size)
  return tokenizer


def _task_kwargs(config: Config, cls: str, tokenizer, *, path: str = "") -> dict:
  """The keyword arguments of the task's prompt source for quota class ``cls``."""
  kwargs = {"cls": cls}
  if path or config.task.path:
    kwargs["path"] = path or config.task.path
    if config.task.prompt_len:  # file-backed prompts longer than the budget are refused
      kwargs["max_prompt_tokens"] = config.task.prompt_len
  if config.vision is not None:  # one placeholder token per image feature the LM reads
    kwargs["image_tokens"] = config.vision.num_image_tokens
    if tokenizer is not None:  # a LLaVA checkpoint's: its image token, images at its size
      kwargs["image_token"] = config.image_token
      kwargs["image_size"] = config.vision.image_size
  if tokenizer is not None:
    kwargs["tokenizer"] = tokenizer
    kwargs["chat"] = {"auto": None, "on": True, "off": False}[config.task.chat]
    kwargs["system_prompt"] = config.task.system_prompt or None
    if config.task.name == "gsm8k":
      kwargs["instruction"] = config.task.instruction
  return kwargs


def build_prompts(config: Config, tokenizer=None) -> ClassStreams:
  """Per-class prompt streams; the quota classes name the task's classes.

  ``tokenizer``: a Hugging Face tokenizer (`build_tokenizer`), or None for the task's own.
  """
  hf_tokenizer = build_tokenizer(config) if tokenizer is None else tokenizer
  sources = {}
  for i, cls in enumerate(sorted(config.admission.quotas)):
    kwargs = _task_kwargs(config, cls, hf_tokenizer)
    source, tokenizer = make_prompt_source(config.task.name, seed=config.seed + 1000 * i, **kwargs)
    sources[cls] = source
  longest = max(_longest_prompt(s) for s in sources.values())
  prompt_len = config.task.prompt_len or longest
  if prompt_len < longest:
    raise ValueError(
      f"config.task.prompt_len={prompt_len} is shorter than the longest prompt ({longest} tokens)."
    )
  if tokenizer.vocab_size > config.model.vocab_size:
    raise ValueError(
      f"config.model.vocab_size={config.model.vocab_size} is smaller than the task's "
      f"tokenizer ({tokenizer.vocab_size} tokens)."
    )
  if config.vision is not None:
    _check_images(config, sources)
  return ClassStreams(sources=sources, tokenizer=tokenizer, prompt_len=prompt_len)


def _heldout_path(config: Config) -> str:
  """Where held-out prompts come from: ``config.eval.path``, else the task's held-out split."""
  if config.eval.path:
    return config.eval.path
  if config.task.path.startswith(gsm8k.GENERATED):
    family, _ = gsm8k.generated_path(config.task.path)
    return f"{gsm8k.GENERATED}{family}:heldout"
  return ""


def build_eval_prompts(config: Config, prompts: ClassStreams, *, path: str = "") -> list[Prompt]:
  """``config.eval.prompts`` held-out prompts, spread over the quota classes in order.

  A file-backed task needs a held-out file (``config.eval.path``) or a generated split; a
  generated task (arith, longtail, count_images) draws from a stream of another seed, the same
  distribution as training (its examples are not disjoint from the training stream's).
  ``path``: another held-out set's (one of ``config.eval.extra_paths``) instead.
  """
  from knitjax.tasks.registry import FILE_TASKS

  path = path or _heldout_path(config)
  if config.task.name in FILE_TASKS and not path:
    raise ValueError(
      f"config.eval needs held-out prompts for task {config.task.name!r}: set config.eval.path "
      "to a JSONL file the run does not train on (or config.task.path='generated:train')."
    )
  tokenizer = None if isinstance(prompts.tokenizer, CharTokenizer) else prompts.tokenizer
  classes = sorted(config.admission.quotas)
  out: list[Prompt] = []
  for i, cls in enumerate(classes):
    n = config.eval.prompts // len(classes) + (i < config.eval.prompts % len(classes))
    kwargs = _task_kwargs(config, cls, tokenizer, path=path)
    if "max_prompt_tokens" in kwargs:
      del kwargs["max_prompt_tokens"]  # held-out prompts may be longer than training's
    source, _ = make_prompt_source(
      config.task.name, seed=_EVAL_SEED + config.seed + i, shuffle=not path, **kwargs
    )
    if path and source.num_examples < n:
      logging.warning(
        "config.eval.prompts=%d asks for %d held-out prompts of class %r, but %s holds %d: "
        "evaluating those %d.",
        config.eval.prompts,
        n,
        cls,
        path,
        source.num_examples,
        source.num_examples,
      )
    out += source.next(min(n, source.num_examples) if path else n)
  return out


def build_eval_sets(config: Config, prompts: ClassStreams) -> dict[str, list[Prompt]]:
  """The held-out sets by name: ``""`` the prompts of `build_eval_prompts`, then one per path of
  ``config.eval.extra_paths`` under its `gsm8k.set_name`."""
  sets = {"": build_eval_prompts(config, prompts)}
  for path in config.eval.extra_paths:
    if path == _heldout_path(config):
      raise ValueError(
        f"config.eval.extra_paths names {path!r}, the held-out set evaluated anyway "
        "(config.eval.path, or the task's held-out split); drop it from extra_paths."
      )
    sets[gsm8k.set_name(path)] = build_eval_prompts(config, prompts, path=path)
  return sets


# Generated tasks draw held-out prompts from a stream of this seed offset (training uses 1000*i).
_EVAL_SEED = 7_777_777


def _check_images(config: Config, sources: dict[str, PromptSource]) -> None:
  v = config.vision
  want = (v.image_size, v.image_size, v.channels)
  for cls, source in sources.items():
    image = copy.copy(source).next(1)[0].image
    if image is None or image.shape != want:
      got = None if image is None else image.shape
      raise ValueError(
        f"config.vision expects images of shape {want} but class {cls!r} of task "
        f"{config.task.name!r} gives {got}."
      )


def build_mesh(config: Config, devices=None) -> jax.sharding.Mesh:
  return sharding.make_mesh(config.mesh.shape, devices=devices)


def build_model(config: Config, mesh) -> tuple[nnx.GraphDef, nnx.State]:
  """Sharded random init of the policy (seeded by ``config.seed``), or the checkpoint of
  ``config.init_from`` read tensor by tensor onto the mesh (a VLM for a LLaVA checkpoint).

  With LoRA (``config.model.lora_rank``) the params hold fresh adapters (B = 0) beside the base,
  which is stored in ``config.model.lora_base_dtype``.
  """
  m = config.model
  sharding.check_tensor_parallel(
    mesh,
    num_heads=m.num_heads,
    num_kv_heads=m.num_kv_heads,
    ffn_dim=m.ffn_dim,
    vocab_size=m.vocab_size,
  )
  graphdef, params = _build_model(config, mesh)
  if config.model.lora_rank:
    params = lora.cast_base(params, config.model.lora_base_dtype, mesh)
  return graphdef, params


def _build_model(config: Config, mesh) -> tuple[nnx.GraphDef, nnx.State]:
  if config.init_from and config.vision is not None:
    from knitjax.models import hf_vision

    # hf_vision.init_vlm_from_hf, but with config.vision's dtype, which may differ from the
    # decoder's (the shapes are the checkpoint's: config.from_config_dict read them).
    _, _, image_id = hf_vision.llava_config_from_hf(config.init_from)
    graphdef, abstract = nnx.split(
      nnx.eval_shape(
        lambda: VLM(config.model, config.vision, image_token_id=image_id, rngs=nnx.Rngs(0))
      )
    )
    return graphdef, hf_vision.load_llava_params(config.init_from, abstract, mesh)
  if config.init_from:
    from knitjax.models import hf

    _, graphdef, params = hf.init_from_hf(
      config.init_from, mesh, config=config.model, seed=config.seed
    )
    if config.model.value_head:
      return _add_value_head(config, params, mesh)
    return graphdef, params
  from knitjax.models import hf

  hf.check_fits_devices(config.model, "config.model", mesh)  # before tracing (init_from: there)
  if config.vision is not None:
    image_id = count_images.image_token_id(count_images.make_tokenizer())
    return sharding.init_sharded(
      lambda: VLM(config.model, config.vision, image_token_id=image_id, rngs=nnx.Rngs(config.seed)),
      mesh,
    )
  return sharding.init_sharded(lambda: Transformer(config.model, rngs=nnx.Rngs(config.seed)), mesh)


def _add_value_head(config: Config, trunk: nnx.State, mesh) -> tuple[nnx.GraphDef, nnx.State]:
  """A checkpoint's params with a fresh (zero) critic head: the policy of PPO with a critic."""
  _, head = sharding.init_sharded(lambda: ValueHead(config.model.d_model, rngs=nnx.Rngs(0)), mesh)
  abstract = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(abstract)
  pure = {**nnx.to_pure_dict(trunk), "value_head": nnx.to_pure_dict(head)}
  nnx.replace_by_pure_dict(params, pure)
  return graphdef, params


def build_trainer(config: Config, graphdef, params, mesh, *, prompt_len: int = 0):
  """Returns ``(state, state_shardings, compiled step, the step's third argument or None)``.

  ``prompt_len``: the prompts' padded width (``ClassStreams.prompt_len``); with shared prompts
  in fixed spans the step then attends span by span (``StepHParams.shared_spans``); 0 (a
  learner that never trains, e.g. for export): by the segment and prefix ids, the same result.

  The third argument is the reference params when the loss has a KL term (a copy of the initial
  params); with LoRA it is the frozen base, always (the train state holds only the adapters, and
  the reference policy is the base with the adapters off: no copy).
  """
  optimizer = make_optimizer(config.optimizer)
  frozen = None
  if config.model.lora_rank:
    params, frozen = lora.split(params)
  state, shardings = init_train_state(params, optimizer, mesh)
  hparams = StepHParams(
    loss=losses.LossConfig(
      eps_low=config.loss.eps_low,
      eps_high=config.loss.eps_high,
      aggregation=config.loss.aggregation,
      objective=config.loss.objective,
      ratio_level=config.loss.ratio_level,
      tis_cap=config.loss.tis_cap or None,
      eps_c=config.loss.eps_c or None,
      kl_coef=config.loss.kl_coef,
      kl_estimator=config.loss.kl_estimator,
      kl_clamp=config.loss.kl_clamp or None,
      kl_penalty=config.loss.kl_penalty,
      entropy_coef=config.loss.entropy_coef,
    ),
    advantage=AdvantageConfig(
      estimator=config.loss.advantage,
      gamma=config.critic.gamma,
      gae_lambda=config.critic.gae_lambda,
      whiten=config.loss.whiten_advantages,
      value_coef=config.critic.value_coef,
      value_clip=config.critic.value_clip or None,
    ),
    temperature=config.rollout.temperature,
    max_new_tokens=config.rollout.max_new_tokens,
    logprob_chunk=config.layout.logprob_chunk,
    shared_spans=shared_spans(config, prompt_len),
  )
  with_ref = config.loss.kl_coef > 0 and frozen is None
  layout = build_layout(config, mesh, prompt_len)
  packed = dict(packed=layout.packed, shared=layout.shared, prefixed=layout.prefixed)
  compile_kwargs = dict(
    graphdef=graphdef,
    optimizer=optimizer,
    hparams=hparams,
    state_shardings=shardings,
    mesh=mesh,
    with_ref=with_ref,
  )
  if config.vision is not None:
    step = mm_step.compile_mm_train_step(
      encoder_dedup=config.vlm.encoder_dedup,
      remat_encoder=config.vlm.remat_encoder,
      shared=layout.shared,
      prefixed=layout.prefixed,
      **compile_kwargs,
    )
  elif frozen is not None:
    step = compile_train_step(
      frozen_shardings=sharding.state_shardings(frozen, mesh), **packed, **compile_kwargs
    )
    return state, shardings, step, frozen
  else:
    step = compile_train_step(**packed, **compile_kwargs)
  ref = reference_params(params, config.loss.reference_dtype) if with_ref else None
  return state, shardings, step, ref


def reference_params(params: nnx.State, dtype: str) -> nnx.State:
  """The KL reference policy: a copy of the initial params, floating leaves stored in ``dtype``
  (the step's forward casts them to the compute dtype at use, like the policy's)."""
  target = jnp.dtype(dtype)

  def copy(x):  # always a new buffer: the train step donates (deletes) the params it was given
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != target:
      return x.astype(target)
    return x.copy()

  return jax.tree.map(copy, params)


def init_state(
  config: Config, mesh, *, prompt_len: int = 0
) -> tuple[nnx.GraphDef, TrainState, TrainState, object, object]:
  graphdef, params = build_model(config, mesh)
  state, shardings, step, ref = build_trainer(config, graphdef, params, mesh, prompt_len=prompt_len)
  return graphdef, state, shardings, step, ref


def build_learner(
  config: Config, mesh, workdir: str, *, prompt_len: int = 0, on_batch=None
) -> tuple[nnx.GraphDef, Learner]:
  """The policy's graph definition and a Learner over its freshly initialised train state
  (``prompt_len``: see `build_trainer`; ``on_batch``: see `Learner`)."""
  graphdef, state, _, step, extra = init_state(config, mesh, prompt_len=prompt_len)
  lora_base = extra if config.model.lora_rank else None
  learner = Learner(
    state,
    step,
    ref_params=None if lora_base is not None else extra,
    frozen=lora_base,
    checkpointer=Checkpointer(workdir, keep=config.checkpoint.keep),
    every_steps=config.checkpoint.every_steps,
    mode=config.topology.mode,
    on_batch=on_batch,
  )
  return graphdef, learner


def build_admission(config: Config, on_reject=None) -> AdmissionIndex:
  a = config.admission
  spec = QuotaSpec(
    class_quotas=dict(a.quotas),
    minibatches=a.minibatches,
    min_per_minibatch=dict(a.min_per_minibatch),
    max_per_minibatch=dict(a.max_per_minibatch),
  )
  return AdmissionIndex(spec, a.policy, dynamic_sampling=a.dynamic_sampling, on_reject=on_reject)


def rng_for(seed: int, step: int) -> jax.Array:
  """The rollout RNG of a train step: a pure function of the seed and step (resumable)."""
  return jax.random.fold_in(jax.random.key(seed), step)


def build_feed(config: Config, take, prepare, *, count: int):
  """The trainer's feed of prepared mini-batches (``config.transfer.mode``).

  ``take``: the source of released mini-batches; ``prepare``: `build_preparer`'s.
  """
  if config.transfer.mode == "centralized":
    return CentralizedFeed(take, prepare, count=count, minibatches=config.admission.minibatches)
  return OnDemandFeed(take, prepare, count=count, prefetch=config.pipeline.prefetch)


def build_preparer(config: Config, storage, mesh, prompts: ClassStreams, *, plan_for=None):
  """This consumer's access to released mini-batches: on demand (fetch its groups, lay out,
  place on the train mesh, one mini-batch at a time) or the centralized baseline (a whole step
  gathered by one driver). ``plan_for``: the announced consumer plan of a mini-batch (a trainer
  of several processes, `knitjax.distributed.trainer_processes`); None: planned alike by every
  consumer."""
  row_spec = RowSpec(
    estimator=config.loss.advantage,
    prompt_len=prompts.prompt_len,
    max_new_tokens=config.rollout.max_new_tokens,
    pad_id=prompts.tokenizer.pad_id,
  )
  layout = build_layout(config, mesh, prompts.prompt_len)
  k = config.layout.micro_batches
  if config.transfer.mode == "centralized":
    return CentralizedPreparer(
      storage, row_spec=row_spec, mesh=mesh, micro_batches=k, layout=layout
    )
  return MiniBatchPreparer(
    storage,
    row_spec=row_spec,
    mesh=mesh,
    micro_batches=k,
    layout=layout,
    locality_slack=config.pipeline.locality_slack,
    plan_for=plan_for,
  )
