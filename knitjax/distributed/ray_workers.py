"""The rollout in Ray actors (``topology.rollout_workers``), on this machine or across a cluster.

Each actor generates on its node's devices into a Ray storage unit on that node
(`knitjax.distributed.ray_rollout`); this process only offers the groups' metadata to the
admission index, and its consumers fetch the payloads on demand. Every device of this process
trains: each version is published as this process's own shards, put in Ray's object store
(`knitjax.distributed.weight_shards.ShardPublisher`), the same way a trainer of several
processes publishes (`knitjax.distributed.trainer_processes`).

The number of actors can change while the run goes on (``python -m knitjax.scale``,
`knitjax.distributed.elastic`): the pipe polls the request between train steps.

Ray is joined at ``topology.ray_address`` (a cluster someone manages) or started locally with
token authentication (`knitjax.distributed.local_ray`).
"""

from __future__ import annotations

import dataclasses
import functools
import uuid

import jax

from knitjax.config import Config
from knitjax.distributed.local_ray import ensure_ray
from knitjax.runtime import builder, rollout_builder
from knitjax.runtime.pipeline import Pipeline
from knitjax.runtime.weight_sync import resolve_sync_dtype
from knitjax.transfer.storage import StorageUnit


def hosted_rollout(config: Config, storage: StorageUnit, cache: bool = False):
  """A Ray actor's rollout (`knitjax.distributed.ray_rollout.RolloutFactory`): the model skeleton
  and the configured rollout on the actor's local devices, writing into ``storage``.

  ``cache``: use this user's compilation cache on each node (`shared_compilation_cache`): the
  actors of a node after the first load its compiled rollout instead of compiling it again,
  so an actor that joins a running run (or replaces a dead one) is generating in seconds, not
  after a compile long enough for its first groups to fall far behind the trainer.
  """
  from knitjax.distributed.ray_rollout import HostedRollout

  if cache:
    shared_compilation_cache()

  devices = jax.local_devices()
  config = dataclasses.replace(
    config, mesh=dataclasses.replace(config.mesh, shape=(len(devices), 1, 1))
  )
  mesh = builder.build_mesh(config, devices=devices)
  prompts = builder.build_prompts(config)
  graphdef, params = builder.build_model(config, mesh)
  rollout = rollout_builder.local_rollout(config, graphdef, mesh, prompts, storage)
  warmup = prompts.next({next(iter(config.admission.quotas)): 1})[0]  # this actor's copy
  return HostedRollout(rollout, params, mesh, warmup)


CACHE_BYTES = 2 << 30  # JAX drops the least recently used entries beyond this


def shared_compilation_cache() -> str:
  """Points JAX's persistent compilation cache of this process at ``<tmp>/knitjax-jit-<uid>``,
  owner-only (a cache others could write would run their code here) and at most
  ``CACHE_BYTES``; returns the folder. Entries are keyed by the computation, so runs share it."""
  import os
  import stat
  import tempfile

  path = os.path.join(tempfile.gettempdir(), f"knitjax-jit-{os.geteuid()}")
  os.makedirs(path, mode=0o700, exist_ok=True)
  st = os.lstat(path)
  if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
    raise PermissionError(f"the compilation cache {path} is not an owner-only folder of this user.")
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jax.config.update("jax_compilation_cache_max_size", CACHE_BYTES)
  return path


def ray_rollout(config: Config, prompts, *, workdir: str = ""):
  """``topology.rollout_workers`` Ray actors generating the configured rollout."""
  ensure_ray(
    config.topology.ray_address,
    needed_by="config.topology.rollout_workers > 0",
    token_dir=workdir,
  )
  from knitjax.distributed.ray_rollout import RayRollout

  return RayRollout(
    functools.partial(hosted_rollout, config, cache=True),
    rollout_builder.build_storage_limits(config, prompts),
    config.topology.rollout_workers,
    groups_per_call=rollout_builder.groups_per_call(config),
    max_restarts=config.topology.actor_restarts,
  )


def shard_publisher(config: Config, board):
  """The publisher of this process's shards of each version to ``board``."""
  from knitjax.distributed.weight_shards import ShardPublisher

  return ShardPublisher(
    board,
    sync_dtype=resolve_sync_dtype(config.sync.dtype, config.model.dtype),
    publish=config.sync.publish,
  )


def new_run_id() -> str:
  """Names a run's Ray actors that others look up (its weights board)."""
  return uuid.uuid4().hex[:12]


class RayWorkers:
  """`knitjax.distributed.topology.Topology`: one trainer process, the rollout in Ray actors."""

  def __init__(self, config: Config, *, workdir: str = ""):
    self._n, self._workdir = config.topology.rollout_workers, workdir

  def split(self, devices: list) -> tuple[list, list]:
    return [], list(devices)

  def rollout(self, config: Config, graphdef, mesh, prompts):
    return ray_rollout(config, prompts, workdir=self._workdir)

  def pipe(self, config, workdir, learner, rollout, admission, prompts, train_mesh, resumed):
    from knitjax.distributed.elastic import ScaleWatch
    from knitjax.distributed.weight_shards import create_board

    weights = shard_publisher(config, create_board(new_run_id(), 1))
    return Pipeline(
      config, workdir, learner, rollout, admission, prompts, resumed,
      train_mesh=train_mesh, weights=weights, scale=ScaleWatch(workdir, rollout, self._n),
    )  # fmt: skip

  def describe(self) -> str:
    return f"{self._n} Ray workers"
