"""The transfer benchmark's quick variant: counted bytes from the real planner and storage."""

import json
import os

import pytest

from configs.bench import transfer as transfer_config
from lab.bench import transfer


def test_quick_counts_bytes_per_mode(tmp_path):
  result = transfer.run(transfer_config.get_config("quick"), str(tmp_path))
  with open(tmp_path / "transfer.json") as f:
    assert json.load(f) == json.loads(json.dumps(result))
  assert os.path.getsize(tmp_path / "transfer.png") > 0
  modes = result["modes"]
  # A central gather-and-scatter moves every byte twice, all through the controller.
  assert modes["centralized"]["cross_host_fraction"] == 2.0
  assert modes["centralized"]["busiest_endpoint_bytes_per_minibatch"] == pytest.approx(
    2 * result["minibatch_bytes"]
  )
  # On-demand reads cross hosts only for the groups the plan could not keep local.
  assert 0 < result["on_demand_local_fraction"] <= 1
  assert modes["on_demand"]["cross_host_fraction"] < modes["hash_placement"]["cross_host_fraction"]
