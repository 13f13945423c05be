"""Weight sync: the trainer publishes versioned parameters; the rollout adopts the newest.

Publishing reshards the trainer's parameters onto the rollout mesh with `jax.device_put` to the
rollout shardings (device to device, never through the host), and waits for the copy: the train
step donates its state, so the source buffers must be read before the next update. Only the
newest published version is kept; a rollout that falls behind skips versions.

With LoRA the trainer publishes only the adapters: the frozen base is placed on the rollout mesh
once (``base``), and each version taken is that base joined with the version's adapters.
"""

from __future__ import annotations

import threading
import time

import jax

from knitjax import faultpoints
from knitjax.models import lora


class WeightSync:
  """The hand-off point between the trainer (publishes) and the rollout (takes)."""

  def __init__(self, rollout_shardings, *, base=None):
    """Args:
    rollout_shardings: pytree of shardings of the published params on the rollout mesh.
    base: with LoRA, the frozen base already on the rollout mesh (published params are then
      the adapters); None: published params are the whole policy.
    """
    self._shardings = rollout_shardings
    self._base = base
    self._lock = threading.Lock()
    self._latest: tuple[int, object] | None = None
    self.published = 0
    self.publish_s = 0.0
    self.published_bytes = 0

  def publish(self, params, version: int) -> float:
    """Copies ``params`` onto the rollout mesh as ``version``; returns the seconds it took."""
    t0 = time.perf_counter()
    moved = jax.device_put(params, self._shardings)
    jax.block_until_ready(moved)
    faultpoints.point("weight_sync")
    seconds = time.perf_counter() - t0
    with self._lock:
      self._latest = (version, moved)
      self.published += 1
      self.publish_s += seconds
      self.published_bytes += lora.tree_bytes(moved)
    return seconds

  def take_newer(self, version: int | None) -> tuple[int, object] | None:
    """The newest ``(version, params)`` if newer than ``version`` (None: any), else None.

    With a ``base`` the params are the base joined with the published adapters (no copy).
    """
    with self._lock:
      latest = self._latest
    if latest is None or (version is not None and latest[0] <= version):
      return None
    if self._base is not None:
      return latest[0], lora.combine(self._base, latest[1])
    return latest
