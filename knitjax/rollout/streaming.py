"""The continuous-batching engine behind the rollout contract.

:class:`StreamingRollout` starts a group as ``G`` requests in free slots of the
:class:`~knitjax.rollout.continuous.ContinuousEngine`, collects finished samples (out of order,
as slots free up), and when the last sample of a group finishes scores the group
(:func:`~knitjax.transfer.assembly.assemble_group`) and writes its payload into the storage unit.
The gen version of a group is the oldest version any of its samples used (partial rollout
records the newest too).

Host work overlaps decoding: a `step` collects the engine call
the previous step launched, launches the next one at once with the queued groups that fit, and
only then scores, assembles and stores the groups the collected call finished, while the device
runs the new call; the caller's own work on the returned groups (admission, weight adoption,
starting the next groups) overlaps it too. Only placing the new requests sits between two calls.
A step therefore returns the groups of the call before the one it launched: in wall time, when
that call has ended and the next is placed (the host may come late for it, after its own work).
Groups the caller starts while a call runs wait in a queue (up to one per prefill lane beyond the
room known then) and go into the slots that call frees, at the next launch; their gen version is
the version they start decoding with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import jax
import numpy as np

from knitjax.rollout.continuous import ContinuousEngine
from knitjax.rollout.contract import RolloutStats
from knitjax.rollout.engine_requests import Finished, Request
from knitjax.tasks.prompts import Prompt
from knitjax.transfer.assembly import assemble_group
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.storage import StorageUnit


class StreamingRollout:
  """Continuous batching: groups start as slots free up and complete out of order.

  Args:
    engine: the engine on the rollout mesh.
    storage: the storage unit payloads go to.
    reward_fn: the verifier.
    tokenizer: the task's tokenizer (rewards decode with it).
    group_size: ``G``.
    budgets: max new tokens per class (classes not named: the engine's ``max_new_tokens``).
  """

  def __init__(
    self,
    engine: ContinuousEngine,
    storage: StorageUnit,
    *,
    reward_fn: Callable,
    tokenizer,
    group_size: int,
    budgets: Mapping[str, int] | None = None,
  ):
    self.engine, self._unit = engine, storage
    self._reward_fn, self._tokenizer = reward_fn, tokenizer
    self._g, self._budgets = group_size, dict(budgets or {})
    self._requests: list[Request] = []  # started, not yet handed to the engine (whole groups)
    self._groups: dict[int, tuple[Prompt, list[Finished | None]]] = {}
    self._tokens = 0

  @property
  def storage(self) -> dict[int, StorageUnit]:
    return {self._unit.unit_id: self._unit}

  @property
  def version(self) -> int | None:
    return self.engine.version

  @property
  def inflight(self) -> int:
    return len(self._groups)

  def adopt(self, params, version: int) -> None:
    self.engine.load(params, version)

  def capacity(self) -> int:
    queued = len(self._requests) // self._g
    if not self.engine.in_flight:
      return self.engine.capacity(self._g, [self._g] * queued)
    # A call is running: the room it frees is known only when it is collected, so up to one
    # group per prefill lane may wait beyond the room known now.
    ahead = self.engine.shards * self.engine.refill_groups
    return max(0, self.engine.capacity(self._g) + ahead - queued)

  def start(self, prompt: Prompt, group_id: int) -> None:
    if self.engine.version is None:
      raise RuntimeError("the rollout has no policy: call adopt(params, version) first.")
    budget = self._budgets.get(prompt.cls, self.engine.sampling.max_new_tokens)
    self._groups[group_id] = (prompt, [None] * self._g)
    self._requests += [
      Request(tag=(group_id, k), tokens=prompt.tokens, max_new_tokens=budget)
      for k in range(self._g)
    ]

  def _take_fitting(self) -> list[Request]:
    """The queued groups, oldest first, that fit in the engine now."""
    n, queued = 0, len(self._requests) // self._g
    while n < queued and self.engine.capacity(self._g, [self._g] * n) > 0:
      n += 1
    taken, self._requests = self._requests[: n * self._g], self._requests[n * self._g :]
    return taken

  def step(self, rng: jax.Array, *, want_room: bool = False) -> list[GroupMeta]:
    finished = self.engine.collect()
    requests = self._take_fitting()
    if requests or self.engine.live_samples:
      # Stop early once a group could start: the caller wants room, or a group is queued.
      room = want_room or bool(self._requests)
      self.engine.launch(requests, rng=rng, stop_free=self._g if room else 0)
    done = []
    for f in finished:
      gid, k = f.tag
      samples = self._groups[gid][1]
      samples[k] = f
      self._tokens += len(f.tokens)
      if all(s is not None for s in samples):
        done.append(self._complete(gid))
    return done

  def _complete(self, gid: int) -> GroupMeta:
    prompt, samples = self._groups.pop(gid)
    n = self.engine.sampling.max_new_tokens
    tokens = np.zeros((self._g, n), np.int32)
    logprobs = np.zeros((self._g, n), np.float32)
    lengths = np.array([len(s.tokens) for s in samples], np.int32)
    for k, s in enumerate(samples):
      tokens[k, : lengths[k]] = s.tokens
      logprobs[k, : lengths[k]] = s.logprobs
    group = assemble_group(
      prompt,
      tokens,
      lengths,
      logprobs,
      group_id=gid,
      version=min(s.version for s in samples),
      version_newest=max(s.version_newest for s in samples),
      reward_fn=self._reward_fn,
      tokenizer=self._tokenizer,
      storage_unit=self._unit.unit_id,
      completion_time=time.time(),
    )
    self._unit.put(gid, group.payload, images=group.images)
    return group.meta

  def stats(self) -> RolloutStats:
    return RolloutStats(
      tokens=self._tokens,
      decode_iterations=self.engine.decode_iterations,
      decode_passes=self.engine.decode_passes,
      chunk_passes=self.engine.chunk_passes,
      rows_decoded=self.engine.rows_decoded,
      prefills=self.engine.prefills,
      live_samples=self.engine.live_samples,
      shards=self.engine.shards,
    )

  def close(self) -> None:
    self._unit.close()  # the unit built for this rollout (a Ray actor with storage='ray')
