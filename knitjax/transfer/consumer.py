"""Consumer planning: which consumer fetches which groups of a released mini-batch.

A consumer is the trainer side of one host (docs/glossary.md): in a multi-host JAX program, process
``c`` of ``C`` holds the data-parallel shards of rows ``[c R/C, (c+1) R/C)`` of every micro-batch
(``R`` rows per micro-batch, rows sharded over ``("data", "fsdp")``), so it must supply exactly
those rows. The plan gives every consumer the same number of complete groups (the global array
needs equal local shapes; a group stays whole so its advantages are computed where it is
fetched), prefers the consumer on the host of the group's storage unit (its bytes never cross
the network), and keeps the consumers' token loads balanced: a group goes home unless that makes
home's load exceed the lightest eligible consumer's by more than ``locality_slack`` of a mean
group. Each consumer then fetches its own groups on demand, straight from their storage units.

The loss does not depend on which consumer computes which row: the mini-batch-wide normalizer
(`knitjax.train.losses.Normalizer`) makes the gradient a sum over rows, so any plan gives the
same update as the whole mini-batch fetched in one place (tested).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.group import GroupMeta


@dataclasses.dataclass(frozen=True)
class ConsumerPlan:
  """One released mini-batch split over consumers; ``groups[c]`` in mini-batch order."""

  step: int
  index: int
  groups: tuple[tuple[GroupMeta, ...], ...]
  home: tuple[int, ...]  # per consumer: how many of its groups live on its own host

  @property
  def num_consumers(self) -> int:
    return len(self.groups)

  def minibatch_for(self, consumer: int) -> MiniBatch:
    """The part of the mini-batch that ``consumer`` fetches, as a mini-batch of its own."""
    return MiniBatch(self.step, self.index, self.groups[consumer])

  def stats(self) -> dict[str, float]:
    """Locality (fraction of groups fetched from the consumer's own host) and token balance."""
    n = sum(len(g) for g in self.groups)
    loads = [sum(_tokens(m) for m in gs) for gs in self.groups]
    mean = sum(loads) / len(loads)
    return {
      "local_fraction": sum(self.home) / max(n, 1),
      "token_imbalance": max(loads) / mean if mean else 1.0,
    }


def _tokens(group: GroupMeta) -> int:
  return sum(group.prompt_tokens) + sum(group.response_tokens)


def plan_consumers(
  minibatch: MiniBatch,
  num_consumers: int,
  *,
  home_of: Callable[[int], int] | None = None,
  locality_slack: float = 0.5,
) -> ConsumerPlan:
  """Assigns the mini-batch's groups to ``num_consumers`` consumers, equal counts each.

  Args:
    minibatch: a released mini-batch.
    num_consumers: consumers sharing the mini-batch (``jax.process_count()`` in a real run).
    home_of: the consumer on the host of a storage unit (default ``unit % num_consumers``).
    locality_slack: how many mean-group token loads a consumer may run above the lightest one
      to keep a group local; 0 balances tokens first, a large value keeps every group local
      when counts allow.
  """
  n = len(minibatch.groups)
  if num_consumers < 1 or n % num_consumers:
    raise ValueError(
      f"a mini-batch of {n} groups cannot be split over {num_consumers} consumers in equal "
      "numbers of groups; choose groups per mini-batch divisible by the number of hosts."
    )
  if locality_slack < 0:
    raise ValueError(f"locality_slack must be >= 0, got {locality_slack}.")
  home_of = home_of or (lambda unit: unit % num_consumers)
  capacity = n // num_consumers
  slack = locality_slack * sum(_tokens(g) for g in minibatch.groups) / max(n, 1)
  loads, counts = [0] * num_consumers, [0] * num_consumers
  owner: dict[int, int] = {}
  # Largest groups first (longest-processing-time order); ties in mini-batch order. Candidates
  # are the consumers with room whose load is within the slack of the lightest; among them home
  # wins, then a consumer whose room exceeds the local groups still to come (so a remote group
  # does not take a place a local one needs), then the lightest.
  order = sorted(range(n), key=lambda i: (-_tokens(minibatch.groups[i]), i))
  local_left = [0] * num_consumers
  for g in minibatch.groups:
    local_left[home_of(g.storage_unit) % num_consumers] += 1
  for i in order:
    g = minibatch.groups[i]
    home = home_of(g.storage_unit) % num_consumers
    local_left[home] -= 1
    room = [c for c in range(num_consumers) if counts[c] < capacity]
    lightest = min(loads[c] for c in room)
    candidates = [c for c in room if loads[c] <= lightest + slack]
    spare = [c for c in candidates if capacity - counts[c] > local_left[c]]
    lightest_first = min(spare or candidates, key=lambda c: (loads[c], c))
    pick = home if home in candidates else lightest_first
    owner[i] = pick
    loads[pick] += _tokens(g)
    counts[pick] += 1
  groups = tuple(
    tuple(minibatch.groups[i] for i in range(n) if owner[i] == c) for c in range(num_consumers)
  )
  home = tuple(
    sum(
      owner[i] == c and home_of(minibatch.groups[i].storage_unit) % num_consumers == c
      for i in range(n)
    )
    for c in range(num_consumers)
  )
  return ConsumerPlan(minibatch.step, minibatch.index, groups, home)
