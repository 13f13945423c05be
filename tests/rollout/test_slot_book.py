"""The host's book of the engine's slots, lanes and waiting prompts (no device needed)."""

import numpy as np
import pytest

from knitjax.rollout.engine_requests import Request
from knitjax.rollout.slot_book import SlotBook


def _book(**kw):
  args = dict(slots=8, shards=2, refill_groups=1, prompt_len=4, width=4, pad_id=0)
  args.update(max_new_tokens=4, share_prefix=True, queue_prompts=1)
  return SlotBook(**{**args, **kw})


def _group(k, g=2):
  tokens = np.asarray([1, 3 + k], np.int32)
  return [Request(tag=(k, i), tokens=tokens, max_new_tokens=4) for i in range(g)]


def test_prompts_start_in_free_slots_then_wait_in_the_queue():
  book = _book()
  # 2 shards x (4 slots, 1 lane): one prompt starts per shard now, one more queues per shard.
  assert book.capacity(2) == 4
  plan, per_shard = book.take([r for k in range(4) for r in _group(k)])
  assert [p.lane for p in plan] == [0, 1] and sorted(map(len, per_shard)) == [1, 1]
  starts = book.starts(plan, pslot=0)
  assert starts.new.tolist() == [True, True] and book.live_samples == 4
  assert book.queued_samples == 4 and book.capacity(2) == 0
  queue = book.queue(per_shard)
  assert queue.count.tolist() == [1, 1]
  # The call started the queued prompt of shard 0 only, and every sample still runs.
  tag = book.slot_tag.copy()
  tag[[2, 3]] = book.waiting[per_shard[0][0]]
  queued = [[book.waiting[i] for i in idx] for idx in per_shard]
  assert book.collected(tag, np.asarray([True, True]), queued, np.asarray([1, 0])) == 1
  assert book.live_samples == 6 and book.queued_samples == 2


def test_prompts_beyond_the_queue_are_refused_all_or_nothing():
  book = _book()
  plan, _ = book.take([r for k in range(4) for r in _group(k)])  # 2 start, 2 queue: it is full
  book.starts(plan, pslot=0)
  waiting = list(book.waiting)
  with pytest.raises(ValueError, match="device queue holds 2"):
    book.take(_group(4))
  assert book.waiting == waiting and (4, 0) not in {s[0].tag for s in book.samples.values()}
