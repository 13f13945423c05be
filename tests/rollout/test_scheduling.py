"""Prompt scheduling: exact quota proportions (plain); need-driven and throttled (aware)."""

from knitjax.rollout.scheduling import AdmissionAwareScheduler, PlainScheduler
from knitjax.transfer.admission import AdmissionIndex
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.quota import QuotaSpec


def test_plain_scheduler_holds_quota_proportions_in_every_window():
  s = PlainScheduler([48, 16])
  picks = [s.next_class() for _ in range(64 * 3)]
  for k in range(3):
    window = picks[64 * k : 64 * (k + 1)]
    assert window.count(0) == 48 and window.count(1) == 16
  # Spread out, not in blocks: every 4 consecutive starts hold one class-1 group.
  assert all(picks[i : i + 4].count(1) == 1 for i in range(0, 64, 4))


def _group(gid, cls):
  return GroupMeta(
    group_id=gid,
    cls=cls,
    gen_version=0,
    num_samples=1,
    prompt_tokens=(1,),
    response_tokens=(1,),
    reward_std=1.0,
  )


def test_admission_aware_starts_what_is_missing_then_throttles():
  index = AdmissionIndex(QuotaSpec({"a": 3, "b": 1}, 2), "minibatch", dynamic_sampling=True)
  s = AdmissionAwareScheduler(index, [3, 1], horizon_steps=1)
  started = []
  while (c := s.next_class()) is not None:
    s.on_start(c)
    started.append(c)
  assert sorted(started) == [0, 0, 0, 1]  # exactly one step's needs, then throttled
  # Class b's group is rejected by dynamic sampling: b is missing again, a is not.
  s.on_complete(1, accepted=False)
  assert s.next_class() == 1
  # With a 2-step horizon, the next step's needs open up.
  s2 = AdmissionAwareScheduler(index, [3, 1], horizon_steps=2)
  index.offer(_group(0, "a"))
  count = 0
  while s2.next_class() is not None and count < 20:
    s2.on_start(s2.next_class())
    count += 1
  assert count == 7  # 8 groups for two steps, one already complete
