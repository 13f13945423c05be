"""Rollout prompt scheduling: which class the next group's prompt comes from.

`PlainScheduler` starts classes in quota proportion (smooth weighted round-robin, so every window
of `B` starts holds each class's quota exactly), blind to what admission still needs; the
runtime's rollout thread runs it. The simulator's admission-aware alternative is
`knitjax.sim.scheduling.AdmissionAwareScheduler`.

How many groups may have started by a trainer version is the version clock's
(`knitjax.rollout.versions`), not the scheduler's.
"""


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
