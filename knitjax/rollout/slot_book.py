"""The host's book of a continuous engine: its slots, prefill lanes and waiting prompts.

Which sample holds which slot (the device tags slots with these sample ids), which lane prefills
which prompt on which shard, and the prompts waiting in the device-side queue; and what a call's
placement and queue look like as device inputs (`Starts`, `Queue`). The book holds what the last
collected call reported plus what the host placed since: a running call can only free slots and
lanes (or fill them from its own queue, which the host learns at collect), so the book is
conservative while a call runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from knitjax.rollout.engine_requests import Request, group_requests
from knitjax.rollout.engine_state import Queue, Starts, make_queue
from knitjax.rollout.placement import Placement, assign, fit, place


class SlotBook:
  """Slots, lanes and waiting prompts of one engine, as the host knows them.

  Args:
    slots: sample slots (a multiple of ``shards``); shards: batch shards of the rollout mesh.
    refill_groups: prefill lanes of each shard (prompts it prefills at once).
    prompt_len: the widest prompt; width: prompt width on the device (whole chunks).
    pad_id: padding; max_new_tokens: the widest token budget.
    share_prefix: samples with one prompt share one prefill (one lane); False only for the
      engine benchmark's baseline.
    queue_prompts: prompts each shard's device queue holds per call.
  """

  def __init__(
    self,
    *,
    slots: int,
    shards: int,
    refill_groups: int,
    prompt_len: int,
    width: int,
    pad_id: int,
    max_new_tokens: int,
    share_prefix: bool,
    queue_prompts: int,
  ):
    self.slots, self.shards, self.refill_groups = slots, shards, refill_groups
    self.per_shard = slots // shards
    self.prompt_len, self.width, self.pad_id = prompt_len, width, pad_id
    self.max_new_tokens, self.share_prefix = max_new_tokens, share_prefix
    self.queue_prompts = queue_prompts
    # Every sample the engine was given and has not returned, by the engine's own id (the tag the
    # device sees): [request, gen version, newest version, param slot] (versions and param slot
    # set when the call that may start it is launched).
    self.samples: dict[int, list] = {}
    self._next_tag = 0
    self.slot_tag = np.full(slots, -1, np.int32)  # the sample each slot holds (-1: free)
    # Prompts not started yet, oldest first, each a list of sample ids sharing one prompt.
    self.waiting: list[list[int]] = []
    self.lane_busy = [False] * (shards * refill_groups)

  @property
  def free_slots(self) -> int:
    return int(np.sum(self.slot_tag < 0))

  @property
  def live_samples(self) -> int:
    """Samples started and not yet finished (prefilling or decoding)."""
    return self.slots - self.free_slots

  @property
  def queued_samples(self) -> int:
    """Samples given to the engine whose prompt has not started yet (device-side queue)."""
    return sum(len(g) for g in self.waiting)

  def param_slots_in_use(self) -> set[int]:
    """Param slots of the samples in the slots."""
    return {self.samples[t][3] for t in self.slot_tag if t >= 0}

  def _free(self) -> tuple[list[list[int]], list[list[int]]]:
    per, lanes = self.per_shard, self.refill_groups
    slots = [
      [s for s in range(k * per, (k + 1) * per) if self.slot_tag[s] < 0] for k in range(self.shards)
    ]
    free_lanes = [
      [j for j in range(lanes) if not self.lane_busy[k * lanes + j]] for k in range(self.shards)
    ]
    return slots, free_lanes

  def _fit(self, sizes: Sequence[int]) -> tuple[int, list, list[list[int]], list[list[int]]]:
    """How many of the prompts of ``sizes`` (oldest first) start now, their placement, and the
    free slots and lanes left after them."""
    shares, slots, lanes = fit(*self._free(), sizes)
    return len(shares), shares, slots, lanes

  def _queueable(self, size: int) -> bool:
    return self.queue_prompts > 0 and size <= self.per_shard

  def _queue_room(self, left: Sequence[int]) -> int:
    """Prompts the device queue can still take once prompts of ``left`` sizes wait in it
    (negative: they do not all fit)."""
    if not all(map(self._queueable, left)):
      return -1
    return self.shards * self.queue_prompts - len(left)

  def capacity(self, group_size: int, queued: Sequence[int] = ()) -> int:
    """How many more prompts of ``group_size`` samples fit now (started at once or queued on the
    device), after the waiting prompts and prompts of ``queued`` sizes (each a prompt shared by
    that many samples)."""
    per_prompt = [group_size] if self.share_prefix else [1] * group_size
    sizes = [len(g) for g in self.waiting]
    sizes += list(queued) if self.share_prefix else [1] * sum(queued)
    n_fit, _, slots, lanes = self._fit(sizes)
    left = sizes[n_fit:]
    room = self._queue_room(left)
    if room < 0:
      return 0
    n = 0
    while not left and place(slots, lanes, per_prompt) is not None:
      n += 1
    if all(self._queueable(z) for z in per_prompt):
      n += room // len(per_prompt)
    return n

  def take(self, requests: Sequence[Request]) -> tuple[list[Placement], list[list[int]]]:
    """Adds ``requests`` to the waiting prompts; returns where the prompts that fit now start and,
    per shard, the indices of the waiting prompts this call queues on the device (all or nothing:
    ValueError)."""
    groups = group_requests(
      requests,
      prompt_len=self.prompt_len,
      max_new_tokens=self.max_new_tokens,
      share_prefix=self.share_prefix,
    )
    sizes = [len(g) for g in self.waiting] + [len(g) for g in groups]
    n_fit, shares, _, _ = self._fit(sizes)
    left = sizes[n_fit:]
    if self._queue_room(left) < 0:
      raise ValueError(
        f"{len(requests)} requests ({len(groups)} prompts) do not fit: free slots="
        f"{self.free_slots}, free prefill lanes={self.lane_busy.count(False)}, {len(left)} "
        f"prompts would wait but the device queue holds "
        f"{self.shards * self.queue_prompts} (prompts of at most {self.per_shard} samples)."
      )
    for g in groups:
      tags = list(range(self._next_tag, self._next_tag + len(g)))
      self._next_tag += len(g)
      for t, req in zip(tags, g, strict=True):
        self.samples[t] = [req, None, None, None]
      self.waiting.append(tags)
    plan = []
    slots, _ = self._free()
    for tags, group_shares in zip(self.waiting[:n_fit], shares, strict=True):
      for shard, lane, n in group_shares:
        taken, slots[shard] = slots[shard][:n], slots[shard][n:]
        tagged = [(t, self.samples[t][0]) for t in tags[:n]]
        plan.append(Placement(shard * self.refill_groups + lane, taken, tagged))
        tags = tags[n:]
    del self.waiting[:n_fit]
    return plan, assign(len(self.waiting), [len(s) for s in slots])

  def starts(self, plan: list[Placement], pslot: int) -> Starts:
    """The call's direct starts (device input); marks their lanes busy and slots taken."""
    n_lanes = self.shards * self.refill_groups
    prompt = np.full((n_lanes, self.width), self.pad_id, np.int32)
    plen = np.ones(n_lanes, np.int32)
    new = np.zeros(n_lanes, bool)
    wait = np.full(self.slots, -1, np.int32)
    budget = np.ones(self.slots, np.int32)
    tag = np.full(self.slots, -1, np.int32)
    for lane, slots, tagged in plan:
      toks = np.asarray(tagged[0][1].tokens, np.int32)
      prompt[lane, self.width - len(toks) :] = toks
      plen[lane], new[lane] = len(toks), True
      self.lane_busy[lane] = True
      for s, (t, req) in zip(slots, tagged, strict=True):
        wait[s], budget[s], tag[s] = lane % self.refill_groups, req.max_new_tokens, t
        self.slot_tag[s] = t
    return Starts(
      prompt=prompt,
      plen=plen,
      new=new,
      pslot=np.int32(pslot),
      wait=wait,
      budget=budget,
      tag=tag,
    )

  def queue(self, per_shard: list[list[int]]) -> Queue:
    """The call's device queue: per shard, the waiting prompts of ``per_shard`` indices."""
    entries = []
    for idx in per_shard:
      reqs = [(self.samples[self.waiting[i][0]][0], self.waiting[i]) for i in idx]
      entries.append([(r.tokens, len(tags), r.max_new_tokens, tags[0]) for r, tags in reqs])
    return make_queue(entries, depth=self.queue_prompts, width=self.width, pad_id=self.pad_id)

  def collected(
    self, tag: np.ndarray, active: np.ndarray, queued: list[list[list[int]]], taken: np.ndarray
  ) -> int:
    """Records a collected call: the slots' samples ``tag`` and busy lanes ``active`` after it,
    and of the prompts it ``queued`` on each shard the first ``taken`` started (in order).
    Returns how many prompts it started from its queue."""
    self.slot_tag = np.asarray(tag, np.int32).copy()
    self.lane_busy = [bool(a) for a in active]
    started = [g[: int(k)] for g, k in zip(queued, taken, strict=True)]
    ids = {id(g) for gs in started for g in gs}
    self.waiting = [g for g in self.waiting if id(g) not in ids]
    return sum(map(len, started))
