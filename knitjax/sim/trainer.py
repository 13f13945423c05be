"""Simulated trainer: a FIFO of released mini-batches, each costing overhead + tokens x rate.

One optimizer update per mini-batch: the trainer's version is the number of mini-batches it has
finished, and the mini-batch being computed uses (is consumed at) the version before its update.
After the last mini-batch of a step (its weights already published) the trainer can be held for
per-step host work (metrics, logging) before it takes the next mini-batch.
"""

import collections
import math
from collections.abc import Callable

from knitjax.transfer.admission import MiniBatch


class Trainer:
  """Trains released mini-batches in release order, one at a time.

  Attributes:
    version: policy version (mini-batches finished).
    busy_until: wall time the current mini-batch finishes (inf when idle).
    busy_total: seconds spent computing so far (finished mini-batches and per-step holds).
    holding: whether the current busy period is per-step host work, not a mini-batch.
  """

  def __init__(self, s_per_token: float, overhead_s: float):
    self._s_per_token = s_per_token
    self._overhead_s = overhead_s
    self.queue: collections.deque[MiniBatch] = collections.deque()
    self.version = 0
    self.busy_until = math.inf
    self.busy_total = 0.0
    self.holding = False
    self._cost = 0.0

  @property
  def idle(self) -> bool:
    """Whether no mini-batch is being computed."""
    return self.busy_until == math.inf

  def cost(self, tokens: int) -> float:
    """Seconds to compute a mini-batch of ``tokens`` prompt + response tokens."""
    return self._overhead_s + self._s_per_token * tokens

  def start(
    self, t: float, tokens_of: Callable[[MiniBatch], int], extra_s: float = 0.0
  ) -> MiniBatch:
    """Starts the next queued mini-batch at time ``t``; returns it (consumed at ``version``).

    Args:
      t: wall time.
      tokens_of: prompt + response tokens of a mini-batch.
      extra_s: seconds this mini-batch costs beyond its own (e.g. sharing the cores with rollout).
    """
    mb = self.queue.popleft()
    self._cost = self.cost(tokens_of(mb)) + extra_s
    self.busy_until = t + self._cost
    return mb

  def finish(self) -> float:
    """Finishes the current mini-batch (version + 1); returns its cost in seconds."""
    self.version += 1
    self.busy_total += self._cost
    self.busy_until = math.inf
    return self._cost

  def hold(self, t: float, seconds: float) -> None:
    """Keeps the (idle) trainer busy from ``t`` for ``seconds`` of per-step host work."""
    self.holding = True
    self._cost = seconds
    self.busy_until = t + seconds

  def end_hold(self) -> None:
    """Ends a hold; the version does not change."""
    self.holding = False
    self.busy_total += self._cost
    self.busy_until = math.inf
