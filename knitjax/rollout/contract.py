"""The one rollout contract: adopt a policy version, start groups, collect complete groups.

Every rollout implements :class:`Rollout`, whatever generates the samples:

- :class:`knitjax.rollout.worker.BatchedRollout`: the batched sampler; one ``step`` generates
  every started group in one jitted call (a "wave");
- :class:`knitjax.rollout.streaming.StreamingRollout`: the continuous-batching engine; groups
  start as slots free up and finish out of order;
- :class:`knitjax.rollout.multiturn.MultiTurnRollout`: model turns and environment turns (tool
  results) alternate inside each trajectory; one ``step`` is one model turn of every live one;
- :class:`knitjax.distributed.ray_rollout.RayRollout`: either of them inside Ray actors, one per
  rollout host, each writing into a storage unit on its own node.

A rollout writes each complete group's payload into one of its storage units (``storage``) —
payloads stay where they were generated — and returns only the groups' :class:`GroupMeta`, which
the runtime offers to the admission index. Colocated and disaggregated execution drive the same
contract; they differ only in when they call it (:func:`generate` for a whole step, or a rollout
thread that keeps the pipeline full).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

import jax

from knitjax.tasks.prompts import Prompt
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.storage import StorageUnit

# How a rollout takes up a newly adopted version: "new_groups" (a group keeps the version it
# started with; samples decode with their own version) or "mid_generation" (partial rollout: live
# samples switch at once; their gen version stays the oldest they used, the newest is recorded).
ADOPTION = ("new_groups", "mid_generation")


@dataclasses.dataclass
class RolloutStats:
  """Counters a rollout keeps (the runtime's flow metrics and the simulator's calibration)."""

  tokens: int = 0  # response tokens generated
  decode_iterations: int = 0  # decode iterations run (per shard, summed over calls)
  decode_passes: int = 0  # iterations that decoded live samples (continuous engine)
  chunk_passes: int = 0  # iterations that ran a prefill chunk (continuous engine)
  rows_decoded: int = 0  # slot rows decode passes computed (continuous engine; >= tokens)
  prefills: int = 0  # prompts prefilled (continuous engine: once per group share)
  live_samples: int = 0  # samples generating now
  shards: int = 1  # independent decode shards (data-parallel rollout devices)
  actor_restarts: int = 0  # rollout actors replaced after dying (Ray rollouts)
  groups_regenerated: int = 0  # groups generated again because their actor died
  # storage units lost with their node (Ray rollouts): the groups they held are given up
  lost_units: tuple[int, ...] = ()


@runtime_checkable
class Rollout(Protocol):
  """Generates complete groups with the newest adopted policy version."""

  @property
  def storage(self) -> Mapping[int, StorageUnit]:
    """The storage units this rollout writes payloads to, by unit id."""

  @property
  def version(self) -> int | None:
    """Newest adopted policy version (None before the first ``adopt``)."""

  @property
  def inflight(self) -> int:
    """Groups started and not yet returned by ``step``."""

  def adopt(self, params, version: int) -> None:
    """Takes policy ``version`` for groups started from now on (and, with partial rollout,
    for samples already generating)."""

  def capacity(self) -> int:
    """How many more groups ``start`` accepts before the next ``step``."""

  def start(self, prompt: Prompt, group_id: int) -> None:
    """Starts the ``G`` samples of one group (``group_id``: its storage key)."""

  def step(self, rng: jax.Array, *, want_room: bool = False) -> list[GroupMeta]:
    """Advances generation; returns the groups completed (payloads already stored).

    ``want_room``: return as soon as a new group could start (the caller has more to start).
    """

  def stats(self) -> RolloutStats: ...

  def close(self) -> None: ...


def generate(
  rollout: Rollout,
  params,
  prompts: Iterable[Prompt],
  *,
  version: int,
  rng: jax.Array,
  first_group_id: int,
) -> list[GroupMeta]:
  """Generates one complete group per prompt at ``version`` (colocated: a whole step at once).

  Group ids count up from ``first_group_id`` in prompt order; the returned metadata keeps that
  order. Returns once every group is complete.
  """
  rollout.adopt(params, version)
  todo = list(prompts)
  done: dict[int, GroupMeta] = {}
  started, call = 0, 0
  while len(done) < len(todo):
    while started < len(todo) and rollout.capacity() > 0:
      rollout.start(todo[started], first_group_id + started)
      started += 1
    for meta in rollout.step(jax.random.fold_in(rng, call) if call else rng):
      done[meta.group_id] = meta
    call += 1
  return [done[first_group_id + i] for i in range(len(todo))]
