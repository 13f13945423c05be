"""Busy times per train step and the trainer calibration, against hand-computed values."""

import dataclasses

import pytest

from knitjax.sim import costs
from knitjax.sim.workload import ClassSpec, Workload


def hand_workload(**changes) -> Workload:
  """Constant lengths (cv 0), so every busy time can be worked out by hand."""
  w = Workload(
    classes=(
      # Half of class a is rejected: 3 / (1 - 0.5) = 6 groups generated per step.
      ClassSpec(
        name="a",
        quota=3,
        length_mean=100.0,
        length_cv=0.0,
        length_max=1000,
        prompt_tokens=20,
        reject_prob=0.5,
      ),
      # The cap clips b's 500 tokens to 300.
      ClassSpec(
        name="b", quota=1, length_mean=500.0, length_cv=0.0, length_max=300, prompt_tokens=40
      ),
    ),
    group_size=2,
    minibatches=2,
    slots=4,
    decode_s_per_token=0.01,
    occupancy_slowdown=0.5,
    prefill_s_per_token=0.001,
    group_start_pause_s=0.2,
    trainer_s_per_token=0.001,
    trainer_overhead_s=0.5,
    trainer_step_overhead_s=0.3,
  )
  return dataclasses.replace(w, **changes)


def test_rollout_busy_time_hand_computed():
  w = hand_workload()
  # Decode at full occupancy: 0.01 * (1 + 0.5) = 0.015 s/token.
  # a: 6 groups x 2 samples x (0.015 * 100 + 0.001 * 20 = 1.52 s) = 18.24 slot-s
  # b: 1 group  x 2 samples x (0.015 * 300 + 0.001 * 40 = 4.54 s) =  9.08 slot-s
  # (18.24 + 9.08) / 4 slots = 6.83 s, plus 7 group starts x 0.2 s stall = 1.4 s: 8.23 s.
  assert costs.rollout_busy_per_step(w) == pytest.approx(8.23)
  # 8 slots: 27.32 / 8 = 3.415, + 1.4 = 4.815.
  assert costs.rollout_busy_per_step(hand_workload(slots=8)) == pytest.approx(4.815)
  # No occupancy slowdown: a 6 x 2 x (1.0 + 0.02) = 12.24, b 2 x (3.0 + 0.04) = 6.08;
  # 18.32 / 4 = 4.58, + 1.4 = 5.98.
  assert costs.rollout_busy_per_step(hand_workload(occupancy_slowdown=0.0)) == pytest.approx(5.98)
  # No rejections: a 3 x 2 x 1.52 = 9.12; (9.12 + 9.08) / 4 = 4.55, + 4 starts x 0.2 = 5.35.
  no_reject = dataclasses.replace(w.classes[0], reject_prob=0.0)
  w0 = dataclasses.replace(w, classes=(no_reject, w.classes[1]))
  assert costs.rollout_busy_per_step(w0) == pytest.approx(5.35)


def test_trainer_busy_time_hand_computed():
  w = hand_workload()
  # Accepted groups only: a 3 x 2 x (20 + 100) = 720 tokens, b 1 x 2 x (40 + 300) = 680.
  assert costs.trainer_tokens_per_step(w) == pytest.approx(1400)
  # 0.001 x 1400 + 2 mini-batches x 0.5 + 0.3 per step = 1.4 + 1.0 + 0.3 = 2.7 s.
  assert costs.trainer_busy_per_step(w) == pytest.approx(2.7)


def test_calibration_hand_computed():
  w = hand_workload()
  # Target 1.0 x 8.23 - 0.3 (per-step overhead, kept) = 7.93 s to share:
  # per token 0.9 x 7.93 / 1400 = 0.00509785714..., per mini-batch 0.1 x 7.93 / 2 = 0.3965 s.
  c = costs.calibrate_trainer(w)
  assert c.trainer_s_per_token == pytest.approx(7.137 / 1400)
  assert c.trainer_overhead_s == pytest.approx(0.3965)
  assert c.trainer_step_overhead_s == 0.3
  assert costs.trainer_busy_per_step(c) == pytest.approx(8.23)  # 7.137 + 0.793 + 0.3
  # Half the rollout's time, no per-mini-batch share: 0.5 x 8.23 - 0.3 = 3.815 s, all per token.
  half = costs.calibrate_trainer(w, busy_ratio=0.5, overhead_fraction=0.0)
  assert half.trainer_s_per_token == pytest.approx(3.815 / 1400)
  assert half.trainer_overhead_s == 0
  assert costs.trainer_busy_per_step(half) == pytest.approx(4.115)


def test_calibration_balances_busy_times(make_tiny):
  w = make_tiny(reject_a=0.5)
  r = costs.rollout_busy_per_step(w)
  assert costs.trainer_busy_per_step(w) == pytest.approx(r)
  assert w.trainer_overhead_s * w.minibatches == pytest.approx(0.1 * r)
  half = costs.calibrate_trainer(w, busy_ratio=0.5, overhead_fraction=0.0)
  assert costs.trainer_busy_per_step(half) == pytest.approx(0.5 * r)
  assert half.trainer_overhead_s == 0


def test_calibration_refuses_a_step_overhead_beyond_the_target():
  # 0.5 x 8.23 = 4.115 s of trainer time, but the per-step overhead alone is 5 s.
  with pytest.raises(ValueError, match="trainer_step_overhead_s=5.0 alone exceeds"):
    costs.calibrate_trainer(hand_workload(trainer_step_overhead_s=5.0), busy_ratio=0.5)
