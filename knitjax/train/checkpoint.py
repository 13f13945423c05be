"""Checkpoints with orbax: device state (params, optimizer) plus host metadata.

The host metadata holds the one counter that is the truth for progress, the
policy ``version`` (optimizer updates applied); the train step is derived from
it. It also holds the RNG seed data, the prompt iterator state, and whatever
the runtime adds (admission index, staleness counters).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging


class Checkpointer:
  """Saves and restores ``(state, meta)`` in ``workdir/checkpoints/<train step>``."""

  def __init__(self, workdir: str, *, keep: int = 2):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
      item_names=("state", "meta"),
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: Mapping[str, Any]) -> None:
    """Saves asynchronously; a crash mid-save leaves the previous checkpoint intact."""
    self._manager.save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
    )

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
    """Restores onto the shardings of ``abstract_state`` (a pytree of arrays or shape structs).

    Raises:
      FileNotFoundError: no checkpoint exists in the directory.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint found in {self.directory}.")
    target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), abstract_state
    )
    restored = self._manager.restore(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()),
    )
    logging.info("restored checkpoint %s/%d", self.directory, step)
    return restored["state"], dict(restored["meta"])

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
