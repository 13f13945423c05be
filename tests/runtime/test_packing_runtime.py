"""Runs with packed train batches (config.train.packing='pack'): colocated (on-demand access)
and disaggregated (centralized transfer), and the packing config's errors."""

import json
import os

import jax
import pytest

from configs import arith_disagg, arith_tiny
from knitjax import sharding
from knitjax.config import from_config_dict
from knitjax.runtime.train import train
from knitjax.train.packing import PackSpec
from knitjax.transfer.access import BatchLayout
from knitjax.transfer.prepare import MiniBatchPreparer


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
def test_colocated_two_steps_with_packing(tmp_path):
  c = arith_tiny.get_config()
  c.admission.quotas = {"arith": 8}
  c.admission.minibatches = 2
  c.rollout.group_size = 4
  c.runtime.steps = 2
  c.runtime.log_every = 1
  c.train.micro_batches = 2
  c.train.packing = "pack"
  train(from_config_dict(c), str(tmp_path))
  rows = _rows(str(tmp_path))
  assert [r["step"] for r in rows] == [1, 2] and [r["version"] for r in rows] == [2, 4]
  for r in rows:
    assert r["num_seqs"] == 16  # every row of the mini-batch, counted by segment
    assert r["loss"] is not None and r["grad_norm"] > 0


@pytest.mark.slow
def test_disaggregated_centralized_run_with_packing(tmp_path):
  c = arith_disagg.get_config("quick")
  c.transfer.mode = "centralized"
  c.train.packing = "pack"
  c.train.pack_buckets = 2
  train(from_config_dict(c), str(tmp_path))
  rows = _rows(str(tmp_path))
  assert [r["step"] for r in rows] == list(range(1, c.runtime.steps + 1))
  assert all(r["grad_norm"] > 0 for r in rows)


@pytest.mark.parametrize(
  "train_fields, match",
  [
    (
      dict(packing="fold"),
      r"config.train.packing='fold' is not accepted; choose one of: off, pack",
    ),
    (dict(packing="pack", advantage="gae"), r"config.train.packing='pack' is not accepted with "),
    (dict(pack_len=-1), r"config.train.pack_len"),
    (dict(pack_buckets=0), r"config.train.pack_buckets"),
  ],
)
def test_packing_config_errors(train_fields, match):
  c = arith_tiny.get_config()
  c.train.update(train_fields)
  with pytest.raises(ValueError, match=match):
    from_config_dict(c)


def test_on_demand_packing_with_several_consumers_is_refused():
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  layout = BatchLayout(estimator="grpo", prompt_len=4, max_new_tokens=4, pad_id=0)
  with pytest.raises(ValueError, match="not accepted with 2 consumers"):
    MiniBatchPreparer(
      {}, layout=layout, mesh=mesh, micro_batches=1, num_consumers=2, consumer=0,
      pack=PackSpec(pack_len=8, multiple=1),
    )  # fmt: skip
