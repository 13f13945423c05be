"""Runs with packed train batches (config.layout.packing='pack'): colocated (on-demand access)
and disaggregated (centralized transfer), and the packing config's errors."""

import json
import os

import jax
import pytest

from configs import arith_disagg, arith_tiny
from knitjax import sharding
from knitjax.config import from_config_dict
from knitjax.run import train
from knitjax.runtime.builder import build_prompts
from knitjax.train import layouts
from knitjax.train.packing import PackSpec
from knitjax.transfer.access import RowSpec
from knitjax.transfer.prepare import MiniBatchPreparer
from tests import tiny


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_colocated_two_steps_with_packing(tmp_path):
  c = arith_tiny.get_config()
  c.admission.quotas = {"arith": 8}
  c.admission.minibatches = 2
  c.rollout.group_size = 4
  c.loop.steps = 2
  c.loop.log_every = 1
  c.layout.micro_batches = 2
  c.layout.packing = "pack"
  train(from_config_dict(c), str(tmp_path))
  rows = _rows(str(tmp_path))
  assert [r["step"] for r in rows] == [1, 2] and [r["version"] for r in rows] == [2, 4]
  for r in rows:
    assert r["num_seqs"] == 16  # every row of the mini-batch, counted by segment
    assert r["loss"] is not None and r["grad_norm"] > 0


def test_colocated_packed_gae_with_kl_reward_and_packing_metrics(tmp_path):
  """PPO with a critic and the KL as a reward, packed; one mini-batch per step, so each step's
  packing metrics are one packing plan's and must agree with each other."""
  c = arith_tiny.get_config()
  c.admission.quotas = {"arith": 4}
  c.admission.minibatches = 1
  c.rollout.group_size = 4
  c.loop.steps = 2
  c.layout.micro_batches = 2
  tiny.set_fields(c, packing="pack", advantage="gae", kl_coef=0.05, kl_penalty="reward")
  row_len = build_prompts(from_config_dict(c)).prompt_len + c.rollout.max_new_tokens
  c.layout.pack_len = 2 * row_len  # every padded row fits twice
  train(from_config_dict(c), str(tmp_path))
  rows = _rows(str(tmp_path))
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert r["num_seqs"] == 16 and r["grad_norm"] > 0 and r["value_loss"] is not None
    assert r["kl_reward_penalty"] >= 0 and r["explained_variance"] is not None
    # 16 rows in pack_rows sequences, the same real tokens as in the 16 padded rows.
    assert r["pack_segments_mean"] * r["pack_rows"] == pytest.approx(16)
    assert r["pack_fill"] * r["pack_rows"] * 2 == pytest.approx(r["pack_padded_fill"] * 16)
    assert 0 < r["pack_fill"] <= 1 and 0 < r["pack_padded_fill"] <= 1
    # Two rows per sequence; the count is rounded up to micro-batches x batch shards with
    # empty sequences (on this mesh more than the 8 the rows need: the fill shows it).
    assert r["pack_segments_max"] >= 2 and r["pack_rows"] % c.layout.micro_batches == 0


def test_disaggregated_centralized_run_with_packing(tmp_path):
  c = arith_disagg.get_config("quick")
  c.transfer.mode = "centralized"
  c.layout.packing = "pack"
  c.layout.pack_buckets = 2
  train(from_config_dict(c), str(tmp_path))
  rows = _rows(str(tmp_path))
  assert [r["step"] for r in rows] == list(range(1, c.loop.steps + 1))
  assert all(r["grad_norm"] > 0 for r in rows)
  assert all(0 < r["pack_fill"] <= 1 and r["pack_segments_max"] >= 1 for r in rows)


@pytest.mark.parametrize(
  "train_fields, match",
  [
    (
      dict(packing="fold"),
      r"config.layout.packing='fold' is not accepted; choose one of: off, pack",
    ),
    (dict(pack_len=-1), r"config.layout.pack_len"),
    (dict(pack_buckets=0), r"config.layout.pack_buckets"),
  ],
)
def test_packing_config_errors(train_fields, match):
  c = arith_tiny.get_config()
  tiny.set_fields(c, **train_fields)
  with pytest.raises(ValueError, match=match):
    from_config_dict(c)


def test_packing_accepts_in_step_advantages():
  """GAE and the KL as a reward run per segment (tests/train/test_step_advantages.py)."""
  for fields in (dict(advantage="gae"), dict(kl_coef=0.05, kl_penalty="reward")):
    c = arith_tiny.get_config()
    tiny.set_fields(c, packing="pack", **fields)
    cfg = from_config_dict(c)
    layout, loss = cfg.layout, cfg.loss
    assert layout.packing == "pack" and (loss.advantage, loss.kl_penalty) == (
      fields.get("advantage", c.loss.advantage),
      fields.get("kl_penalty", c.loss.kl_penalty),
    )


def test_on_demand_packing_needs_row_shards_divisible_by_the_consumers():
  """Several consumers pack (tests/transfer/test_prepare.py) when each holds an equal share of
  the micro-batches' row shards."""
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  row_spec = RowSpec(estimator="grpo", prompt_len=4, max_new_tokens=4, pad_id=0)
  with pytest.raises(ValueError, match="not accepted with 2 consumers and 1 micro-batch row"):
    MiniBatchPreparer(
      {}, row_spec=row_spec, mesh=mesh, micro_batches=1, num_consumers=2, consumer=0,
      layout=layouts.Packed(PackSpec(pack_len=8, multiple=1)),
    )  # fmt: skip
