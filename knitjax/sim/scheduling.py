"""Which prompt scheduler a simulated pipeline runs (``Pipeline.scheduling``).

* ``plain``: `knitjax.rollout.scheduling.PlainScheduler`, the runtime's: classes in quota
  proportion, blind to what admission still needs.
* ``admission_aware``: `AdmissionAwareScheduler` asks the admission index what the earliest
  unfinished steps still need (`AdmissionIndex.remaining`), subtracts the groups of each class
  already generating (scaled by the acceptance rate observed so far), and starts the class with
  the largest relative shortfall; when no class is short within the depth's horizon it starts
  nothing (throttle), so the rollout never makes groups the index cannot place soon. Only the
  simulator and the staleness benchmark run it, so it lives here.
"""

import math

from knitjax.rollout.scheduling import PlainScheduler
from knitjax.transfer.admission import AdmissionIndex

SCHEDULING = ("plain", "admission_aware")


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


def make_scheduler(kind: str, index: AdmissionIndex, quotas: list[int], horizon_steps: int):
  """Builds the scheduler named by ``Pipeline.scheduling``."""
  if kind == "plain":
    return PlainScheduler(quotas)
  if kind == "admission_aware":
    return AdmissionAwareScheduler(index, quotas, horizon_steps)
  raise ValueError(f"scheduling={kind!r} is not accepted; choose one of: {', '.join(SCHEDULING)}.")
