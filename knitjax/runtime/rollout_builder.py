"""Builds what generates in a run from a validated :class:`~knitjax.config.Config`: the rollout
in one process (batched sampler, continuous engine, multi-turn) over a given storage unit, and the
evaluators, which generate with the same samplers. Where the rollout runs (this process or Ray
actors) and where its storage units live is the topology's choice (`knitjax.distributed`).

The rest of a run's parts (prompts, meshes, the model, the learner, admission and the feed) are
built by `knitjax.runtime.builder`, which this module uses.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax

from knitjax import sharding
from knitjax.config import Config
from knitjax.models.vlm import make_prompt_embedder
from knitjax.rollout.continuous import ContinuousEngine
from knitjax.rollout.multiturn import MultiTurnRollout, stop_ids
from knitjax.rollout.sampler import Sampler, SamplingConfig
from knitjax.rollout.streaming import StreamingRollout
from knitjax.rollout.worker import BatchedRollout, RolloutWorker
from knitjax.runtime.builder import build_eval_sets
from knitjax.runtime.evaluation import EvalLog, Evaluator, PeriodicEval
from knitjax.tasks.registry import make_environment
from knitjax.tasks.rewards import get_reward_fn
from knitjax.tasks.streams import ClassStreams
from knitjax.train.reward_shaping import with_overlong_penalty
from knitjax.transfer.storage import StorageLimits, StorageUnit


def _sampling(config: Config) -> SamplingConfig:
  r = config.rollout
  return SamplingConfig(
    max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p
  )


def training_reward(config: Config):
  """The reward training rollouts score samples with: the task's verifier, plus DAPO's overlong
  penalty when ``config.rollout.overlong_buffer`` is set (evaluation scores the verifier alone)."""
  fn = get_reward_fn(config.task.reward)
  r = config.rollout
  if not r.overlong_buffer:
    return fn
  return with_overlong_penalty(
    fn,
    max_new_tokens=r.max_new_tokens,
    class_max_new_tokens=r.class_max_new_tokens,
    buffer=r.overlong_buffer,
  )


def build_worker(
  config: Config,
  graphdef,
  mesh,
  prompts: ClassStreams,
  *,
  sampling: SamplingConfig | None = None,
  prompt_len: int | None = None,
  reward: str = "",
) -> RolloutWorker:
  """The batched sampler, rewards and group assembly on ``mesh`` (evaluation passes its own
  sampling, prompt length and reward)."""
  r = config.rollout
  prompt_len = prompt_len or prompts.prompt_len
  sampler = Sampler(
    graphdef,
    mesh=mesh,
    sampling=sampling or _sampling(config),
    eos_id=prompts.tokenizer.eos_ids,
    pad_id=prompts.tokenizer.pad_id,
    prompt_len=prompt_len,
  )
  return RolloutWorker(
    sampler=sampler,
    tokenizer=prompts.tokenizer,
    reward_fn=get_reward_fn(reward) if reward else training_reward(config),
    group_size=r.group_size,
    prompt_len=prompt_len,
    class_max_new_tokens=r.class_max_new_tokens,
    prompt_embedder=make_prompt_embedder(graphdef, mesh) if config.vision is not None else None,
  )


def build_periodic_eval(
  config: Config, graphdef, mesh, prompts: ClassStreams, workdir: str, start_step: int
) -> PeriodicEval | None:
  """Evaluation during training when ``config.eval.every_steps`` > 0, else None."""
  if not config.eval.every_steps:
    return None
  return PeriodicEval(
    build_evaluator(config, graphdef, mesh, prompts),
    EvalLog(workdir, start_step=start_step, primary=jax.process_index() == 0),
    every_steps=config.eval.every_steps,
    total_steps=config.loop.steps,
  )


def eval_rng(config: Config) -> jax.Array:
  """The evaluation RNG (folded with the step): the same prompts see the same draws per step."""
  return jax.random.fold_in(jax.random.key(config.seed), 0x5EED)


def build_evaluator(config: Config, graphdef, mesh, prompts: ClassStreams) -> Evaluator:
  """Greedy accuracy and pass@k on ``config.eval``'s held-out sets (`runtime.evaluation`)."""
  e = config.eval
  sets = build_eval_sets(config, prompts)
  prompt_len = max(prompts.prompt_len, *(len(p.tokens) for s in sets.values() for p in s))
  base = _sampling(config)
  if e.max_new_tokens:
    base = dataclasses.replace(base, max_new_tokens=e.max_new_tokens)
  reward = e.reward or config.task.reward
  make = functools.partial(
    build_worker, config, graphdef, mesh, prompts, prompt_len=prompt_len, reward=reward
  )
  greedy = make(sampling=dataclasses.replace(base, temperature=0.0, top_k=0, top_p=1.0))
  sampled = make(sampling=base) if e.samples else None
  return Evaluator(
    greedy=greedy,
    sampled=sampled,
    prompts=sets.pop(""),
    extra_sets=sets,
    reward_fn=get_reward_fn(reward),
    tokenizer=prompts.tokenizer,
    k=e.k,
    samples=e.samples,
    batch_prompts=e.batch_prompts,
    batch_shards=math.prod(mesh.shape[a] for a in sharding.BATCH_AXES),
  )


def build_engine(config: Config, graphdef, mesh, prompts: ClassStreams) -> ContinuousEngine:
  """The continuous-batching engine (``rollout.engine="continuous"``)."""
  r, sync = config.rollout, config.sync
  return ContinuousEngine(
    graphdef,
    mesh=mesh,
    sampling=_sampling(config),
    slots=r.slots,
    prompt_len=prompts.prompt_len,
    eos_id=prompts.tokenizer.eos_ids,
    pad_id=prompts.tokenizer.pad_id,
    refill_groups=r.refill_groups,
    prefill_chunk=r.prefill_chunk,
    decode_steps=r.decode_steps,
    adoption=sync.adoption,
    param_slots=sync.held_versions,
  )


def groups_per_call(config: Config) -> int | None:
  """Groups one batched call generates: a colocated step starts all; disaggregated waves fill
  the slots."""
  if config.topology.mode == "colocated":
    return None
  return max(1, config.rollout.slots // config.rollout.group_size)


def local_rollout(config: Config, graphdef, mesh, prompts: ClassStreams, unit: StorageUnit):
  """The in-process rollout of ``rollout.engine`` on ``mesh``, writing into ``unit``."""
  r = config.rollout
  if r.engine == "multiturn":
    return build_multiturn(config, graphdef, mesh, prompts, unit)
  if r.engine == "continuous":
    return StreamingRollout(
      build_engine(config, graphdef, mesh, prompts),
      unit,
      reward_fn=training_reward(config),
      tokenizer=prompts.tokenizer,
      group_size=r.group_size,
      budgets=r.class_max_new_tokens,
    )
  worker = build_worker(config, graphdef, mesh, prompts)
  return BatchedRollout(worker, unit, max_groups=groups_per_call(config))


def build_multiturn(
  config: Config, graphdef, mesh, prompts: ClassStreams, unit: StorageUnit
) -> MultiTurnRollout:
  """The multi-turn rollout (``rollout.engine="multiturn"``): a sampler whose prompt is a turn's
  whole context (``P + N``), ``turn_tokens`` per turn, stopping also at the environment's stop
  texts; waves of ``slots // group_size`` live groups in disaggregated runs."""
  r = config.rollout
  environment = make_environment(config.task.name)
  sampler = Sampler(
    graphdef,
    mesh=mesh,
    sampling=dataclasses.replace(
      _sampling(config), max_new_tokens=r.turn_tokens or r.max_new_tokens
    ),
    eos_id=stop_ids(environment, prompts.tokenizer),
    pad_id=prompts.tokenizer.pad_id,
    prompt_len=prompts.prompt_len + r.max_new_tokens,
  )
  return MultiTurnRollout(
    sampler,
    unit,
    environment=environment,
    tokenizer=prompts.tokenizer,
    group_size=r.group_size,
    prompt_len=prompts.prompt_len,
    max_new_tokens=r.max_new_tokens,
    max_turns=r.max_turns,
    max_groups=groups_per_call(config),
    adoption=config.sync.adoption,
  )


def build_storage_limits(config: Config, prompts: ClassStreams) -> StorageLimits:
  r, v = config.rollout, config.vision
  return StorageLimits.for_steps(
    vocab_size=config.model.vocab_size,
    max_seq_len=prompts.prompt_len + r.max_new_tokens,
    groups_per_step=config.admission.groups_per_step,
    group_size=r.group_size,
    image_bytes=0 if v is None else v.image_size**2 * v.channels * 4,
  )
