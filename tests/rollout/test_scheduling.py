"""Prompt scheduling: exact quota proportions (the runtime's plain scheduler)."""

from knitjax.rollout.scheduling import PlainScheduler


def test_plain_scheduler_holds_quota_proportions_in_every_window():
  s = PlainScheduler([48, 16])
  picks = [s.next_class() for _ in range(64 * 3)]
  for k in range(3):
    window = picks[64 * k : 64 * (k + 1)]
    assert window.count(0) == 48 and window.count(1) == 16
  # Spread out, not in blocks: every 4 consecutive starts hold one class-1 group.
  assert all(picks[i : i + 4].count(1) == 1 for i in range(0, 64, 4))
