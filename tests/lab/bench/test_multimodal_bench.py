"""The multimodal transfer benchmark's quick variant: both modes, counts checked, JSON + plot."""

import json
import os

import pytest

from configs.bench import multimodal as mm_config
from lab.bench import multimodal


@pytest.fixture
def own_ray():
  """The bench starts a local Ray (as a run does); the next test of this worker gets none."""
  ray = pytest.importorskip("ray")
  if ray.is_initialized():
    ray.shutdown()
  yield
  ray.shutdown()


def test_quick_run_moves_fewer_image_bytes_and_loses_nothing(tmp_path, own_ray):
  c = mm_config.get_config("quick")
  c.sweep = {}
  result = multimodal.run(c, str(tmp_path))
  with open(tmp_path / "multimodal.json") as f:
    saved = json.load(f)
  assert saved == json.loads(json.dumps(result))
  assert os.path.getsize(tmp_path / "multimodal.png") > 0
  r = saved["main"]
  w = r["workload"]
  rows_per_mb = w["groups_per_step"] // w["minibatches"] * w["group_size"]
  for mode in multimodal.MODES:
    counts = r[mode]["counts"]
    assert counts["groups"] == w["groups_per_step"] * c.steps
    assert counts["rows"] == counts["groups"] * w["group_size"]
    assert counts["lost"] == counts["duplicated"] == 0
  # The baseline encodes every row's copy; on demand one image per group (2 per mini-batch).
  assert r["centralized"]["encoder_images_per_minibatch"] == rows_per_mb
  assert r["on_demand"]["encoder_images_per_minibatch"] == 2
  assert r["on_demand"]["encoder_backward_passes_per_minibatch"] == 1
  assert r["centralized"]["encoder_backward_passes_per_minibatch"] == w["micro_batches"]
  # Image bytes: G float32 copies per group against one uint8 image per group.
  assert r["image_bytes_cut"] >= w["group_size"] * 4 * 0.99
  assert r["centralized"]["busiest_endpoint"] == "driver"
  assert set(r["modelled"]) == {"25gbps", "100gbps"}
  assert r["speedup"] > 0 and r["latency_ratio"] > 0
  per_group = r["payload_bytes_per_group"]
  assert per_group["centralized_rows"] > w["group_size"] * per_group["stored"]
