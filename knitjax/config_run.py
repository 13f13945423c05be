"""The config sections of how a run goes: loop, topology, sync, pipeline.

``loop``: how many train steps and how often to log. ``topology``: where rollout, storage and
the trainer run (colocated on one device set, disaggregated on two, Ray rollout workers on other
machines); its fields only together choose a topology (`knitjax.distributed.topology`).
``sync``: how weights reach the rollout.
``pipeline``: how far rollout runs ahead and how consumers fetch. Frozen, keyword-only dataclasses
built by ``config_fields.build_section``, validated on their own; a field that can switch its
feature off declares that value beside it (``config_fields.setting``).
"""

from __future__ import annotations

import dataclasses

from knitjax.config_fields import (
  MAX_CPU_DEVICES,
  MAX_DEVICES,
  MAX_SAMPLES,
  MAX_STEPS,
  one_of,
  positive,
  setting,
)
from knitjax.rollout.contract import ADOPTION
from knitjax.rollout.versions import LAG_UNITS

# Choices the runtime implements; runtime sits above config, so config owns their names.
MODES = ("colocated", "disaggregated")
SYNC_EVERY = ("minibatch", "step")
SYNC_DTYPES = ("auto", "bfloat16", "float32")
SYNC_PUBLISH = ("async", "blocking")
STORAGE = ("in_process", "ray")

MAX_HELD_VERSIONS = 64  # versions the rollout holds at once: far above any lag bound in use


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopConfig:
  """The run loop: train steps and logging."""

  steps: int = 100
  log_every: int = 10

  def __post_init__(self):
    positive("config.loop.steps", self.steps, at_most=MAX_STEPS)
    positive("config.loop.log_every", self.log_every, at_most=MAX_STEPS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TopologyConfig:
  """Where things run: the fields that together choose colocated, disaggregated in process, with
  Ray rollout workers (one or several trainer processes)."""

  mode: str = "colocated"
  # Disaggregated only: the first `rollout_devices` devices form the rollout mesh; a trainer of
  # several processes trains on every device (its rollout is in Ray actors).
  rollout_devices: int = setting(0, off=0, meaning="half of the devices")
  # Storage units: in this process, or Ray actors (needs `pip install -e '.[ray]'`).
  storage: str = "in_process"
  # Passed to ray.init (e.g. "auto").
  ray_address: str = setting("", off="", meaning="start or join a local Ray")
  # Generate in this many Ray actors (each writing to a Ray storage unit on its own node). A
  # disaggregated trainer of several processes (--distributed) needs them: process 0 runs the
  # admission index, every process trains on the one global mesh and fetches its own share
  # (knitjax.distributed.trainer_processes).
  rollout_workers: int = setting(0, off=0, meaning="generate in this process")
  # Ray actor deaths (rollout actors, storage units) a run survives; one more ends it.
  actor_restarts: int = setting(3, off=0, meaning="the first actor death ends the run")

  def __post_init__(self):
    s = TopologyConfig
    one_of("config.topology.mode", self.mode, MODES)
    one_of("config.topology.storage", self.storage, STORAGE)
    positive(
      "config.topology.rollout_workers",
      self.rollout_workers,
      allow_zero=True,
      at_most=MAX_CPU_DEVICES,
      section=s,
    )
    positive("config.topology.actor_restarts", self.actor_restarts, allow_zero=True, section=s)
    positive(
      "config.topology.rollout_devices",
      self.rollout_devices,
      allow_zero=True,
      at_most=MAX_DEVICES,
      section=s,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncConfig:
  """How the trainer's weights reach the rollout (docs/weight_sync.md)."""

  every: str = "minibatch"  # publish after each mini-batch's update, or once a train step
  # Disaggregated publish: the dtype on the wire and the rollout's params ("auto": bfloat16 when
  # config.model.dtype is bfloat16, else float32, so float32 runs stay exact), and whether the
  # trainer waits for the copy ("blocking") or it completes in the background.
  dtype: str = "auto"
  publish: str = "async"
  adoption: str = "new_groups"  # or "mid_generation" (partial rollout)
  # Weight versions the rollout holds at once with adoption="new_groups" (each a whole copy of
  # the params on the rollout devices).
  held_versions: int = 2

  def __post_init__(self):
    one_of("config.sync.every", self.every, SYNC_EVERY)
    one_of("config.sync.dtype", self.dtype, SYNC_DTYPES)
    one_of("config.sync.publish", self.publish, SYNC_PUBLISH)
    one_of("config.sync.adoption", self.adoption, ADOPTION)
    need = 1 + (self.adoption == "new_groups")
    if self.held_versions < need:
      raise ValueError(
        f"config.sync.held_versions={self.held_versions!r} is not accepted; adoption="
        f"{self.adoption!r} needs at least {need}."
      )
    positive("config.sync.held_versions", self.held_versions, at_most=MAX_HELD_VERSIONS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineConfig:
  """Disaggregated pipelining: how far rollout runs ahead, and how consumers fetch."""

  # Pipeline depth in train steps (fractions allowed).
  max_lag_steps: float = setting(1.0, off=0.0, meaning="on-policy: no lag")
  # How depth capacity comes back: "step" (once a step's last mini-batch is consumed) or
  # "minibatch" (each consumed mini-batch frees its B/M groups; version-granular).
  lag_unit: str = "step"
  # On-demand access: mini-batches each consumer prepares ahead of its update.
  prefetch: int = setting(1, off=0, meaning="each mini-batch fetched when its update starts")
  # How far token balance may give way to fetching locally.
  locality_slack: float = setting(0.5, off=0.0, meaning="token balance first")

  def __post_init__(self):
    s = PipelineConfig
    one_of("config.pipeline.lag_unit", self.lag_unit, LAG_UNITS)
    positive("config.pipeline.max_lag_steps", self.max_lag_steps, allow_zero=True, section=s)
    positive(
      "config.pipeline.prefetch", self.prefetch, allow_zero=True, at_most=MAX_SAMPLES, section=s
    )
    positive("config.pipeline.locality_slack", self.locality_slack, allow_zero=True, section=s)


RUN_SECTIONS = {
  "loop": LoopConfig,
  "topology": TopologyConfig,
  "sync": SyncConfig,
  "pipeline": PipelineConfig,
}
