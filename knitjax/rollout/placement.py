"""Where new prompts go in the continuous engine: a shard with free slots and a free prefill lane.

A prompt shared by ``n`` samples (a group's ``G``, with prefix sharing) is prefilled once per
shard it lands on; the engine's book of slots (`knitjax.rollout.slot_book`) plans every call's
starts and checks room (`ContinuousEngine.capacity`) with `place`.
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
