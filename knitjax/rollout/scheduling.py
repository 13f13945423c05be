"""Rollout prompt scheduling: which class the next group's prompt comes from.

* `PlainScheduler`: classes in quota proportion (smooth weighted round-robin, so every window of
  `B` starts holds each class's quota exactly), blind to what admission still needs.
* `AdmissionAwareScheduler`: asks the admission index what the earliest unfinished steps still
  need (`AdmissionIndex.remaining`), subtracts the groups of each class already generating
  (scaled by the acceptance rate observed so far), and starts the class with the largest
  relative shortfall; when no class is short within the depth's horizon it starts nothing
  (throttle), so the rollout never makes groups the index cannot place soon.

How many groups may have started by a trainer version is the version clock's
(`knitjax.rollout.versions`), not the scheduler's.
"""

import math

# LAG_UNITS is the version clock's; re-exported only until knitjax/config.py imports it from
# knitjax.rollout.versions (config.py is being rewritten elsewhere).
from knitjax.rollout.versions import LAG_UNITS  # noqa: F401
from knitjax.transfer.admission import AdmissionIndex


class PlainScheduler:
  """Classes in quota proportion, deterministic."""

  def __init__(self, quotas: list[int]):
    self._w = list(quotas)
    self._total = sum(quotas)
    self._credit = [0] * len(quotas)

  def next_class(self) -> int | None:
    """Index of the class to start next."""
    credit = self._credit
    for c, w in enumerate(self._w):
      credit[c] += w
    best = max(range(len(credit)), key=credit.__getitem__)
    credit[best] -= self._total
    return best

  def on_start(self, c: int) -> None:
    """No state beyond the round-robin credit."""

  def on_complete(self, c: int, accepted: bool) -> None:
    """Plain scheduling ignores outcomes."""


class AdmissionAwareScheduler:
  """Starts the class the open steps need most; throttles when none is needed.

  Args:
    index: the admission index whose ``remaining`` it reads.
    quotas: per-class groups per step (class order).
    horizon_steps: how many unfinished steps the rollout may work for (``1 + ceil(depth)``).
  """

  def __init__(self, index: AdmissionIndex, quotas: list[int], horizon_steps: int):
    self._index = index
    self._names = list(index.spec.classes)
    self._quotas = list(quotas)
    self._horizon = max(1, horizon_steps)
    n = len(quotas)
    self._inflight = [0] * n
    self._completed = [0] * n
    self._accepted = [0] * n

  def _acceptance(self, c: int) -> float:
    # Laplace-smoothed observed rate: the scheduler cannot know the rejection probability.
    return (self._accepted[c] + 1) / (self._completed[c] + 1)

  def next_class(self) -> int | None:
    """Index of the class to start next, or None to start nothing now."""
    for h in range(1, self._horizon + 1):
      remaining = self._index.remaining(h)
      best, best_gap = None, -math.inf
      for c, name in enumerate(self._names):
        # Expected groups still missing once the ones generating complete; a half group or more
        # is worth a start (rounds expected counts, so no systematic over-generation).
        short = remaining[name] - self._inflight[c] * self._acceptance(c)
        if short >= 0.5 and short / self._quotas[c] > best_gap:
          best, best_gap = c, short / self._quotas[c]
      if best is not None:
        return best
    return None

  def on_start(self, c: int) -> None:
    """Counts a started group of class ``c``."""
    self._inflight[c] += 1

  def on_complete(self, c: int, accepted: bool) -> None:
    """Counts a completed group and whether dynamic sampling accepted it."""
    self._inflight[c] -= 1
    self._completed[c] += 1
    self._accepted[c] += accepted
