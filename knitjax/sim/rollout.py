"""Simulated rollout fleet: `S` sample slots with continuous batching and a shared token clock.

Continuous batching advances every active sample by one token per decode iteration, so all
samples progress at the same rate in *tokens*, whatever the occupancy does to the iteration time.
The pool therefore keeps a token clock ``tau`` (iterations since the start) and stores each
sample's finish as a point on that clock: the order of finishes never changes when the rate does,
so one heap of finish points is exact, and wall time is recovered per event from the current
iteration time. Pauses for weight sync (and group starts that stall decoding) stop the token
clock.
"""

import heapq
import math

import numpy as np


class SlotPool:
  """Continuous batching over `slots` sample slots (one per active sample).

  Attributes:
    t: wall time (seconds) the state refers to.
    tau: token clock (decode iterations run so far).
    active: samples holding a slot.
    pause_until: decoding is paused until this wall time (weight sync).
    busy_area: integral of ``active`` over wall time (slot-seconds held).
  """

  __slots__ = (
    "slots",
    "decode_s",
    "slowdown",
    "t",
    "tau",
    "active",
    "pause_until",
    "busy_area",
    "pause_total",
    "_samples",
    "_groups",
  )

  def __init__(self, slots: int, decode_s_per_token: float, occupancy_slowdown: float = 0.0):
    self.slots = slots
    self.decode_s = decode_s_per_token
    self.slowdown = occupancy_slowdown
    self.t = 0.0
    self.tau = 0.0
    self.active = 0
    self.pause_until = 0.0
    self.busy_area = 0.0
    self.pause_total = 0.0
    self._samples: list[float] = []  # heap of token-clock points where a sample frees its slot
    self._groups: list[tuple[float, int]] = []  # heap of (token-clock finish, group id)

  @property
  def free(self) -> int:
    """Free slots."""
    return self.slots - self.active

  def iteration_s(self) -> float:
    """Seconds per decode iteration at the current occupancy."""
    return self.decode_s * (1.0 + self.slowdown * self.active / self.slots)

  def time_of(self, tau: float) -> float:
    """Wall time at which the token clock reaches ``tau`` if occupancy stays as it is."""
    start = self.t if self.t > self.pause_until else self.pause_until
    return start + max(0.0, tau - self.tau) * self.iteration_s()

  def advance(self, t: float) -> None:
    """Moves the state to wall time ``t`` (no event in between)."""
    dt = t - self.t
    if dt <= 0:
      return
    self.busy_area += self.active * dt
    run_from = self.t if self.t > self.pause_until else self.pause_until
    if t > run_from:
      self.tau += (t - run_from) / self.iteration_s()
    self.t = t

  def pause(self, seconds: float, *, sync: bool = True) -> None:
    """Pauses decoding for ``seconds`` from now (queued after a pause already running).

    ``sync``: the pause is a weight sync (counted in ``pause_total``); otherwise another stall of
    the whole pool, e.g. a group start whose prefill interrupts decoding.
    """
    start = max(self.t, self.pause_until)
    self.pause_until = start + seconds
    if sync:
      self.pause_total += seconds

  def start(self, group_id: int, work: np.ndarray) -> None:
    """Starts a group now; ``work[i]`` is sample i's slot time in decode iterations."""
    finishes = (self.tau + work).tolist()
    for f in finishes:
      heapq.heappush(self._samples, f)
    heapq.heappush(self._groups, (max(finishes), group_id))
    self.active += len(finishes)

  def next_event(self) -> tuple[float, int]:
    """``(wall time, kind)`` of the next rollout event: kind 0 frees a slot, kind 1 completes a
    group, -1 means none. A slot frees before the group it completes (ties go to slots)."""
    if not self._samples:
      if self._groups:  # unreachable: a group's last sample is in the heap until it finishes
        return self.time_of(self._groups[0][0]), 1
      return math.inf, -1
    ts = self._samples[0]
    if self._groups and self._groups[0][0] < ts:
      return self.time_of(self._groups[0][0]), 1
    return self.time_of(ts), 0

  def pop_slot(self, t: float) -> None:
    """Processes the next slot-freeing event at wall time ``t``."""
    tau = heapq.heappop(self._samples)
    self.advance(t)
    self.tau = tau  # exact point; avoids drift from the time round trip
    self.active -= 1

  def pop_group(self, t: float) -> int:
    """Processes the next group completion at wall time ``t``; returns the group id."""
    tau, gid = heapq.heappop(self._groups)
    self.advance(t)
    self.tau = max(self.tau, tau)
    return gid

  @property
  def inflight_groups(self) -> int:
    """Groups started and not complete."""
    return len(self._groups)
