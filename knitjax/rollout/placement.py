"""Where new prompts go in the continuous engine: a shard with free slots and a free prefill lane.

A prompt shared by ``n`` samples (a group's ``G``, with prefix sharing) is prefilled once per
shard it lands on; the engine's host side (`knitjax.rollout.continuous`) plans every call's
starts with `fit` and checks room (`ContinuousEngine.capacity`) with it. Prompts that do not
fit may wait in the device-side queue of one shard (`assign`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Placement(NamedTuple):
  """One prompt's share on one shard: a lane prefills it once for these slots."""

  lane: int  # global lane index (shard * refill_groups + local)
  slots: list[int]  # global slot indices
  requests: list  # (sample id, the engine's `Request`) for these slots, in slot order


def place(
  free_slots: list[list[int]], free_lanes: list[list[int]], sizes: Sequence[int]
) -> list[list[tuple[int, int, int]]] | None:
  """Where prompts of ``sizes`` samples go: per prompt, ``(shard, lane, n)`` shares.

  Greedy: each prompt goes to the shard with the most free slots that has a free lane; a prompt
  larger than any shard's free slots is split over several shards (one lane each). The lists are
  consumed. Returns None when some prompt does not fit.
  """
  out = []
  for size in sizes:
    shares, left = [], size
    while left:
      ok = [s for s in range(len(free_slots)) if free_lanes[s] and free_slots[s]]
      if not ok:
        return None
      s = max(ok, key=lambda s: (len(free_slots[s]) >= left, len(free_slots[s]), -s))
      n = min(left, len(free_slots[s]))
      shares.append((s, free_lanes[s].pop(0), n))
      del free_slots[s][:n]
      left -= n
    out.append(shares)
  return out


def fit(
  free_slots: list[list[int]], free_lanes: list[list[int]], sizes: Sequence[int]
) -> tuple[list[list[tuple[int, int, int]]], list[list[int]], list[list[int]]]:
  """The longest prefix of the prompts of ``sizes`` (oldest first) that starts now: its shares
  (as `place` gives them, one list per prompt), and the free slots and lanes left after it."""
  slots, lanes = free_slots, free_lanes
  shares = []
  for size in sizes:
    trial = [list(x) for x in slots], [list(x) for x in lanes]
    got = place(*trial, [size])
    if got is None:
      break
    (slots, lanes), shares = trial, shares + got
  return shares, slots, lanes


def assign(n: int, free: Sequence[int]) -> list[list[int]]:
  """Queued prompts ``0 .. n-1`` over the shards (``free``: free slots of each): each to the shard
  with the fewest queued so far, then the most free slots, then the lowest index."""
  per_shard: list[list[int]] = [[] for _ in free]
  for i in range(n):
    k = min(range(len(free)), key=lambda k: (len(per_shard[k]), -free[k], k))
    per_shard[k].append(i)
  return per_shard
