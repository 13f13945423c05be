"""The host's book of a continuous engine: its slots and prefill lanes.

Which sample holds which slot (the device tags slots with these sample ids) and which lane
prefills which prompt on which shard; and what a call's placement looks like as device input
(`Starts`). The book holds what the last collected call reported plus what the host placed
since: a running call can only free slots and lanes, so the book is conservative while a call
runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from knitjax.rollout.engine_requests import Request, group_requests
from knitjax.rollout.engine_state import Starts
from knitjax.rollout.placement import Placement, place


class SlotBook:
  """Slots and lanes of one engine, as the host knows them.

  Args:
    slots: sample slots (a multiple of ``shards``); shards: batch shards of the rollout mesh.
    refill_groups: prefill lanes of each shard (prompts it prefills at once).
    prompt_len: the widest prompt; width: prompt width on the device (whole chunks).
    pad_id: padding; max_new_tokens: the widest token budget.
    share_prefix: samples with one prompt share one prefill (one lane); False only for the
      engine benchmark's baseline.
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
  ):
    self.slots, self.shards, self.refill_groups = slots, shards, refill_groups
    self.per_shard = slots // shards
    self.prompt_len, self.width, self.pad_id = prompt_len, width, pad_id
    self.max_new_tokens, self.share_prefix = max_new_tokens, share_prefix
    # Every sample the engine was given and has not returned, by the engine's own id (the tag the
    # device sees): [request, gen version, newest version, param slot] (set when the call that
    # starts it is launched).
    self.samples: dict[int, list] = {}
    self._next_tag = 0
    self.slot_tag = np.full(slots, -1, np.int32)  # the sample each slot holds (-1: free)
    self.lane_busy = [False] * (shards * refill_groups)

  @property
  def free_slots(self) -> int:
    return int(np.sum(self.slot_tag < 0))

  @property
  def live_samples(self) -> int:
    """Samples started and not yet finished (prefilling or decoding)."""
    return self.slots - self.free_slots

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

  def _sizes(self, group_size: int, prompts: int) -> list[int]:
    """Slots each prompt takes: ``prompts`` prompts of ``group_size`` samples."""
    return [group_size] * prompts if self.share_prefix else [1] * (group_size * prompts)

  def capacity(self, group_size: int, queued: Sequence[int] = ()) -> int:
    """How many more prompts of ``group_size`` samples start now, after prompts of ``queued``
    sizes (each a prompt shared by that many samples)."""
    slots, lanes = self._free()
    before = [n for z in queued for n in self._sizes(z, 1)]
    if place(slots, lanes, before) is None:
      return 0
    n = 0
    while place(slots, lanes, self._sizes(group_size, 1)) is not None:
      n += 1
    return n

  def take(self, requests: Sequence[Request]) -> list[Placement]:
    """Where the prompts of ``requests`` start: all of them, or none (ValueError)."""
    groups = group_requests(
      requests,
      prompt_len=self.prompt_len,
      max_new_tokens=self.max_new_tokens,
      share_prefix=self.share_prefix,
    )
    shares = place(*self._free(), [len(g) for g in groups])
    if shares is None:
      raise ValueError(
        f"{len(requests)} requests ({len(groups)} prompts) do not fit: free slots="
        f"{self.free_slots}, free prefill lanes={self.lane_busy.count(False)}; check capacity() "
        "first."
      )
    plan = []
    slots, _ = self._free()
    for g, group_shares in zip(groups, shares, strict=True):
      tags = list(range(self._next_tag, self._next_tag + len(g)))
      self._next_tag += len(g)
      for t, req in zip(tags, g, strict=True):
        self.samples[t] = [req, None, None, None]
      for shard, lane, n in group_shares:
        taken, slots[shard] = slots[shard][:n], slots[shard][n:]
        tagged = [(t, self.samples[t][0]) for t in tags[:n]]
        plan.append(Placement(shard * self.refill_groups + lane, taken, tagged))
        tags = tags[n:]
    return plan

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

  def collected(self, tag: np.ndarray, active: np.ndarray) -> None:
    """Records a collected call: the slots' samples ``tag`` and busy lanes ``active`` after it."""
    self.slot_tag = np.asarray(tag, np.int32).copy()
    self.lane_busy = [bool(a) for a in active]
