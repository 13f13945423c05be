"""The host's book of the engine's slots and lanes (no device needed)."""

import numpy as np
import pytest

from knitjax.rollout.engine_requests import Request
from knitjax.rollout.slot_book import SlotBook


def _book(**kw):
  args = dict(slots=8, shards=2, refill_groups=1, prompt_len=4, width=4, pad_id=0)
  args.update(max_new_tokens=4, share_prefix=True)
  return SlotBook(**{**args, **kw})


def _group(k, g=2):
  tokens = np.asarray([1, 3 + k], np.int32)
  return [Request(tag=(k, i), tokens=tokens, max_new_tokens=4) for i in range(g)]


def test_prompts_start_in_free_slots_and_lanes_and_are_released_at_collect():
  book = _book()
  # 2 shards x (4 slots, 1 lane): one prompt of 2 samples starts on each shard now.
  assert book.capacity(2) == 2 and book.capacity(2, queued=[2]) == 1
  plan = book.take([r for k in range(2) for r in _group(k)])
  assert [p.lane for p in plan] == [0, 1] and [len(p.slots) for p in plan] == [2, 2]
  starts = book.starts(plan, pslot=0)
  assert starts.new.tolist() == [True, True] and book.live_samples == 4
  assert book.capacity(2) == 0  # both lanes prefill
  # The call ended shard 0's samples and both prefills: its lane and slots are free again.
  tag = book.slot_tag.copy()
  tag[:4] = -1
  book.collected(tag, np.asarray([False, False]))
  assert book.live_samples == 2 and book.capacity(2) == 2


def test_prompts_that_do_not_fit_are_refused_all_or_nothing():
  book = _book()
  book.starts(book.take([r for k in range(2) for r in _group(k)]), pslot=0)  # both lanes busy
  samples = dict(book.samples)
  with pytest.raises(ValueError, match=r"do not fit: free slots=4, free prefill lanes=0"):
    book.take(_group(2))
  assert book.samples == samples


def test_without_prefix_sharing_each_sample_takes_a_lane():
  book = _book(refill_groups=4)
  assert book.capacity(2) == 4  # 8 lanes, 2 samples a prompt: 4 prompts
  plan = book.take(_group(0))
  assert len(plan) == 1 and len(plan[0].slots) == 2
  book = _book(refill_groups=4, share_prefix=False)
  assert book.capacity(2) == 4
  assert len(book.take(_group(0))) == 2  # one lane per sample
