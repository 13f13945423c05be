"""The version clock: the trainer's policy version as the rollout sees it, and the pipeline-depth
bound on what the rollout may start by each version.

Rollout may start a group only while the groups started so far, minus those dynamic sampling
rejected, are fewer than ``B * (completed_steps + 1) + depth``, where ``completed_steps`` is the
trainer's version divided by ``M`` and ``depth = max_lag_steps * B`` (whole mini-batches). This is
the simulator's rule (`knitjax.sim.engine`, like AReaL's ``max_head_offpolicyness``), so the
simulated and the measured pipelines bound staleness the same way. With
``pipeline.lag_unit="minibatch"`` capacity comes back per consumed mini-batch instead
(`start_limit`).

The runtime's rollout thread waits on `VersionClock`; the simulator applies `start_limit` to its
own clock, and config validates ``pipeline.lag_unit`` against `LAG_UNITS`. The module sits in the
rollout layer so that all three import it (docs/architecture.md).
"""

from __future__ import annotations

import threading

LAG_UNITS = ("step", "minibatch")


def start_limit(
  version: int, *, groups_per_step: int, minibatches: int, lag_groups: int, lag_unit: str = "step"
) -> int:
  """Accepted groups (started minus rejected) that may have started by trainer ``version``.

  ``lag_unit="step"``: ``B * (version // M + 1) + lag_groups``: capacity comes back a whole
  step at a time, once the step's last mini-batch is consumed (AReaL's
  ``max_head_offpolicyness``). ``"minibatch"``: ``B + (B / M) * version + lag_groups``: each
  consumed mini-batch returns its ``B / M`` groups at once (version-granular), so rollout never
  idles waiting for the rest of a step. At a step boundary both give the same limit.
  """
  if lag_unit == "step":
    return groups_per_step * (version // minibatches + 1) + lag_groups
  if lag_unit == "minibatch":
    return groups_per_step + (groups_per_step // minibatches) * version + lag_groups
  raise ValueError(f"lag_unit={lag_unit!r} is not accepted; choose one of {LAG_UNITS}.")


def lag_groups(max_lag_steps: float, *, groups_per_step: int, minibatches: int) -> int:
  """``max_lag_steps`` in groups; raises ValueError unless it is a whole number of mini-batches."""
  units = max_lag_steps * minibatches
  if max_lag_steps < 0 or abs(units - round(units)) > 1e-6:
    raise ValueError(
      f"config.pipeline.max_lag_steps={max_lag_steps!r} is not accepted; it must be a multiple of "
      f"1/M = 1/{minibatches} and >= 0."
    )
  return round(units) * (groups_per_step // minibatches)


class VersionClock:
  """Thread-safe trainer version with the depth bound; the rollout waits on it.

  Args:
    version: the trainer's version now.
    groups_per_step: ``B``.
    minibatches: ``M``.
    max_lag_steps: pipeline depth in train steps (a multiple of 1/M).
    lag_unit: ``"step"`` or ``"minibatch"``: how capacity comes back (see `start_limit`).
  """

  def __init__(
    self,
    version: int,
    *,
    groups_per_step: int,
    minibatches: int,
    max_lag_steps: float,
    lag_unit: str = "step",
  ):
    self._cond = threading.Condition()
    self._version = version
    self._stopped = False
    if lag_unit not in LAG_UNITS:
      raise ValueError(
        f"config.pipeline.lag_unit={lag_unit!r} is not accepted; choose one of {LAG_UNITS}."
      )
    self._b, self._m, self.lag_unit = groups_per_step, minibatches, lag_unit
    self.lag_groups = lag_groups(
      max_lag_steps, groups_per_step=groups_per_step, minibatches=minibatches
    )

  @property
  def version(self) -> int:
    with self._cond:
      return self._version

  @property
  def stopped(self) -> bool:
    with self._cond:
      return self._stopped

  def limit(self, weights_version: int | None = None) -> int:
    """Accepted groups (started minus rejected) that may have started by now, on weights of
    ``weights_version``: the bound is reckoned at the older of it and the trainer's version, so
    a version published after the rollout adopted its weights does not let groups start on
    those older weights (an asynchronous publish, or a Ray rollout's object-store copy, opens
    that window)."""
    with self._cond:
      version = self._version if weights_version is None else min(self._version, weights_version)
      return start_limit(
        version,
        groups_per_step=self._b,
        minibatches=self._m,
        lag_groups=self.lag_groups,
        lag_unit=self.lag_unit,
      )

  def advance(self, version: int) -> None:
    """Records a new trainer version and wakes the rollout."""
    with self._cond:
      self._version = version
      self._cond.notify_all()

  def stop(self) -> None:
    """Tells the rollout to finish (end of training or an error)."""
    with self._cond:
      self._stopped = True
      self._cond.notify_all()

  def wait(self, version: int, timeout: float) -> None:
    """Blocks until the version differs from ``version``, a stop, or ``timeout`` seconds."""
    with self._cond:
      self._cond.wait_for(lambda: self._version != version or self._stopped, timeout)
