"""Exact feasibility of completing a train step, in closed form and incrementally.

State of the current train step: mini-batches before the open one are released; the open
mini-batch holds ``x[c]`` groups of class `c` and has ``a`` free slots; ``k`` empty mini-batches
follow it; ``r[c]`` groups of class `c` are still missing from the step's quota. A *completion*
puts exactly ``r[c]`` more groups of each class into the open and the empty mini-batches so that
every mini-batch ends with ``S`` groups and ``lo[c] <= count <= hi[c]`` of each class.

Theorem (proved in docs/admission.md, checked against brute force in tests): a completion
exists iff, with per class

  L[c] = max(0, lo[c] - x[c], r[c] - k * hi[c])
  U[c] = min(hi[c] - x[c], r[c] - k * lo[c]),

every ``L[c] <= U[c]`` and ``sum(L) <= a <= sum(U)``. (`L`/`U` bound how many groups of class
`c` the open mini-batch may still take: the rest, ``r[c] - z[c]``, must fit into `k` identical
empty mini-batches, which is possible iff ``k * lo[c] <= r[c] - z[c] <= k * hi[c]``.)

Placing one group of class `c` into the open mini-batch changes only ``L[c]``, ``U[c]`` and
``a``, so `FeasibilityTracker` answers "may this group go in now?" in O(1).
"""

from collections.abc import Sequence


def completion_feasible(
  lows: Sequence[int],
  highs: Sequence[int],
  size: int,
  open_counts: Sequence[int],
  remaining: Sequence[int],
  empty_minibatches: int,
) -> bool:
  """Whether the step state admits a completion (the closed form above; O(classes)).

  Args:
    lows: per-class minimum per mini-batch.
    highs: per-class maximum per mini-batch (at most ``size``).
    size: groups per mini-batch `S`.
    open_counts: groups of each class already in the open mini-batch.
    remaining: groups of each class still missing from the step (not yet placed anywhere).
    empty_minibatches: `k`, empty mini-batches of the step after the open one.

  Returns:
    True iff the remaining groups can be placed so that every mini-batch of the step is full
    and within its bounds.
  """
  free = size - sum(open_counts)
  if free < 0 or sum(remaining) != free + empty_minibatches * size:
    return False
  k = empty_minibatches
  sum_lo = sum_hi = 0
  for lo, hi, x, r in zip(lows, highs, open_counts, remaining, strict=True):
    if r < 0:
      return False
    low = max(0, lo - x, r - k * hi)
    high = min(hi - x, r - k * lo)
    if low > high:
      return False
    sum_lo += low
    sum_hi += high
  return sum_lo <= free <= sum_hi


class FeasibilityTracker:
  """Incremental form of `completion_feasible` for the open mini-batch of one train step."""

  def __init__(
    self, quotas: Sequence[int], lows: Sequence[int], highs: Sequence[int], minibatches: int
  ):
    """Starts at the beginning of a step (mini-batch 0 open and empty).

    Args:
      quotas: per-class groups per step.
      lows: per-class minimum per mini-batch.
      highs: per-class maximum per mini-batch (at most the mini-batch size).
      minibatches: `M`, mini-batches per step.
    """
    self.quotas = list(quotas)
    self.lows = list(lows)
    self.highs = list(highs)
    self.minibatches = minibatches
    self.size = sum(self.quotas) // minibatches
    self.start_step()

  def start_step(self) -> None:
    """Opens mini-batch 0 of a fresh step."""
    self.set_state([0] * len(self.quotas), list(self.quotas), self.minibatches - 1)

  def next_minibatch(self) -> None:
    """Opens the next (empty) mini-batch of the same step; the current one must be full."""
    if self.free:
      raise RuntimeError(f"next_minibatch with {self.free} free slots in the open mini-batch.")
    self.set_state([0] * len(self.quotas), self.remaining, self.empty - 1)

  def set_state(self, open_counts: Sequence[int], remaining: Sequence[int], empty: int) -> None:
    """Sets the state (open counts, remaining quota, empty mini-batches) and recomputes."""
    self.counts = list(open_counts)
    self.remaining = list(remaining)
    self.empty = empty
    self.free = self.size - sum(self.counts)
    k, cols = empty, (self.lows, self.highs, self.counts, self.remaining)
    self._low = [max(0, lo - x, r - k * hi) for lo, hi, x, r in zip(*cols, strict=True)]
    self._high = [min(hi - x, r - k * lo) for lo, hi, x, r in zip(*cols, strict=True)]
    self._bad = sum(low > high for low, high in zip(self._low, self._high, strict=True))
    self._sum_low = sum(self._low)
    self._sum_high = sum(self._high)

  def feasible(self) -> bool:
    """Whether the current state admits a completion."""
    return self._bad == 0 and self._sum_low <= self.free <= self._sum_high

  def can_place(self, c: int) -> bool:
    """Whether the state after adding one group of class `c` to the open mini-batch is feasible."""
    r = self.remaining[c] - 1
    if r < 0 or self.free < 1:
      return False
    low, high = self._bounds(c, self.counts[c] + 1, r)
    old_low, old_high = self._low[c], self._high[c]
    if low > high or self._bad - (old_low > old_high) != 0:
      return False
    free = self.free - 1
    return self._sum_low - old_low + low <= free and free <= self._sum_high - old_high + high

  def place(self, c: int) -> None:
    """Adds one group of class `c` to the open mini-batch (feasible or not, e.g. for replay)."""
    self.counts[c] += 1
    self.remaining[c] -= 1
    self.free -= 1
    low, high = self._bounds(c, self.counts[c], self.remaining[c])
    old_low, old_high = self._low[c], self._high[c]
    self._bad += (low > high) - (old_low > old_high)
    self._sum_low += low - old_low
    self._sum_high += high - old_high
    self._low[c], self._high[c] = low, high

  def _bounds(self, c: int, x: int, r: int) -> tuple[int, int]:
    lo, hi, k = self.lows[c], self.highs[c], self.empty
    return max(0, lo - x, r - k * hi), min(hi - x, r - k * lo)


def balanced_split(quotas: Sequence[int], minibatches: int) -> list[list[int]]:
  """Per-class counts for each of `minibatches` mini-batches, as even as possible.

  Class `c` gets ``quotas[c] // M`` or one more in every mini-batch, so any bounds with
  ``M * lo <= quota <= M * hi`` hold; the extras are dealt round-robin over consecutive
  mini-batches, which gives every mini-batch the same size when ``M`` divides the total.

  Args:
    quotas: per-class group counts of one step.
    minibatches: `M`.

  Returns:
    ``counts[j][c]``: groups of class `c` in mini-batch `j`.
  """
  m = minibatches
  if sum(quotas) % m:
    raise ValueError(f"balanced_split: the quotas sum to {sum(quotas)}, not a multiple of {m}.")
  counts = [[q // m for q in quotas] for _ in range(m)]
  pos = 0
  for c, q in enumerate(quotas):
    for _ in range(q % m):
      counts[pos % m][c] += 1
      pos += 1
  return counts
