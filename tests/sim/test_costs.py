"""Trainer calibration: trainer busy time per step equals rollout busy time per step."""

import dataclasses

import pytest

from knitjax.sim import costs


def test_calibration_balances_busy_times(make_tiny):
  w = make_tiny(reject_a=0.5)
  r = costs.rollout_busy_per_step(w)
  assert costs.trainer_busy_per_step(w) == pytest.approx(r)
  assert w.trainer_overhead_s * w.minibatches == pytest.approx(0.1 * r)
  half = costs.calibrate_trainer(w, busy_ratio=0.5, overhead_fraction=0.0)
  assert costs.trainer_busy_per_step(half) == pytest.approx(0.5 * r)
  assert half.trainer_overhead_s == 0


def test_rejections_and_slots_scale_rollout_busy_time(make_tiny):
  w = make_tiny()
  base = costs.rollout_busy_per_step(w)
  # Class a is 6 of 8 groups; rejecting half of it doubles its generated groups.
  a = w.classes[0]
  a_share = a.quota * (
    costs.mean_length(a) * w.decode_s_per_token + a.prompt_tokens * w.prefill_s_per_token
  )
  b = w.classes[1]
  b_share = b.quota * (
    costs.mean_length(b) * w.decode_s_per_token + b.prompt_tokens * w.prefill_s_per_token
  )
  assert base == pytest.approx((a_share + b_share) * w.group_size / w.slots)
  assert costs.rollout_busy_per_step(make_tiny(reject_a=0.5)) == pytest.approx(
    base + a_share * w.group_size / w.slots
  )
  assert costs.rollout_busy_per_step(dataclasses.replace(w, slots=64)) == pytest.approx(base / 2)
