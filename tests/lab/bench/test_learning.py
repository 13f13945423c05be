"""Learning-quality judgement: the colocated-final target and a fixed target, by hand."""

import numpy as np
import pytest

from lab.bench import learning


def _run(rewards, versions_per_step=4):
  rows = [
    {"step": i + 1, "version": versions_per_step * (i + 1), "reward_mean": r}
    for i, r in enumerate(rewards)
  ]
  return {"rows": rows, "wall": np.arange(1.0, len(rewards) + 1)}


def test_fixed_target_is_judged_beside_the_colocated_final_target():
  # window 1: the moving average is the reward itself, so every figure reads off the lists.
  runs = {
    "colocated": [_run([0.0, 0.2, 0.4, 0.6])],  # final 0.6: colocated reaches it at its last step
    "train_batch": [_run([0.0, 0.5, 0.7, 0.7])],
    "minibatch": [_run([0.1, 0.3, 0.5, 0.5])],
  }
  got = learning.evaluate(runs, window=1, fixed_target=0.5)
  assert got["target_reward"] == pytest.approx(0.6)
  assert {m: r["version"] for m, r in got["reached"].items()} == {
    "colocated": 16,  # by construction: its own last step
    "train_batch": 12,
    "minibatch": None,
  }
  assert got["fixed_target"] == 0.5
  assert {m: r["version"] for m, r in got["reached_fixed"].items()} == {
    "colocated": 16,
    "train_batch": 8,
    "minibatch": 12,
  }
  assert got["per_seed"][0]["reached_fixed"]["minibatch"]["step"] == 3
  assert not got["minibatch_within_budget"]
