"""The rollout in this process: on the train devices (colocated) or on its own (disaggregated).

A disaggregated run gives the first ``topology.rollout_devices`` devices (half by default) to the
rollout and publishes each version onto them (`knitjax.runtime.weight_sync.WeightSync`, no host
detour). The storage units live in this process, or in Ray actors with ``topology.storage="ray"``
(`knitjax.distributed.ray_storage`).
"""

from __future__ import annotations

import jax

from knitjax import sharding
from knitjax.config import Config
from knitjax.runtime import rollout_builder
from knitjax.runtime.pipeline import Pipeline
from knitjax.runtime.weight_sync import WeightSync, resolve_sync_dtype
from knitjax.transfer.storage import InProcessStorageUnit, StorageUnit


def split_devices(config: Config, devices: list) -> tuple[list, list]:
  """``(rollout devices, train devices)``: the first ``topology.rollout_devices`` go to rollout."""
  devices = list(devices)
  r = config.topology.rollout_devices or len(devices) // 2
  if not 1 <= r < len(devices):
    raise ValueError(
      f"config.topology.rollout_devices={config.topology.rollout_devices} leaves no devices for "
      f"one side of {len(devices)}; choose 1..{len(devices) - 1} (0: half)."
    )
  return devices[:r], devices[r:]


def build_storage(config: Config, prompts, *, unit_id: int = 0, workdir: str = "") -> StorageUnit:
  """A storage unit sized for a few train steps of payload: in this process, or a Ray actor
  (``topology.storage="ray"``, starting or joining Ray)."""
  limits = rollout_builder.build_storage_limits(config, prompts)
  if config.topology.storage == "ray":
    from knitjax.distributed.local_ray import ensure_ray
    from knitjax.distributed.ray_storage import RayStorageUnit

    ensure_ray(
      config.topology.ray_address, needed_by="config.topology.storage='ray'", token_dir=workdir
    )
    return RayStorageUnit(limits, unit_id=unit_id, max_restarts=config.topology.actor_restarts)
  return InProcessStorageUnit(limits, unit_id=unit_id)


class InProcess:
  """`knitjax.distributed.topology.Topology`: rollout and trainer in this one process."""

  def __init__(self, config: Config, *, workdir: str = ""):
    self._config, self._mesh, self._workdir = config, None, workdir

  def split(self, devices: list) -> tuple[list, list]:
    return split_devices(self._config, devices)

  def rollout(self, config: Config, graphdef, mesh, prompts):
    self._mesh = mesh  # versions are published onto it
    unit = build_storage(config, prompts, workdir=self._workdir)
    return rollout_builder.local_rollout(config, graphdef, mesh, prompts, unit)

  def pipe(self, config, workdir, learner, rollout, admission, prompts, train_mesh, resumed):
    mesh = self._mesh
    weights = WeightSync(
      sharding.state_shardings(learner.state.params, mesh),
      base=_rollout_base(learner.frozen, mesh),
      sync_dtype=resolve_sync_dtype(config.sync.dtype, config.model.dtype),
      publish=config.sync.publish,
    )
    return Pipeline(
      config, workdir, learner, rollout, admission, prompts, resumed,
      train_mesh=train_mesh, weights=weights,
    )  # fmt: skip

  def describe(self) -> str:
    return f"{self._mesh.size} devices"


def _rollout_base(frozen, mesh):
  """With LoRA, the frozen base placed once on the rollout mesh: versions then carry only the
  adapters."""
  if frozen is None:
    return None
  return jax.device_put(frozen, sharding.state_shardings(frozen, mesh))
