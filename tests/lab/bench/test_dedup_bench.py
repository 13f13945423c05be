"""The dedup benchmark's quick variant: a complete JSON whose counts come from the step itself."""

import json
import os

import numpy as np
import pytest

from configs.bench import dedup as dedup_config
from lab.bench import dedup


def test_workload_spreads_every_group_over_every_micro_batch():
  config = dedup_config.get_config()
  from knitjax.models.transformer import TransformerConfig
  from knitjax.models.vision import VisionConfig

  w = config.workload
  batch = dedup.make_workload(
    lm=TransformerConfig(**config.model.to_dict()),
    vision=VisionConfig(**config.vision.to_dict()),
    **w.to_dict(),
  )
  k = w.micro_batches
  index = batch["image_index"].reshape(k, -1)
  for mb in index:  # each micro-batch holds G / K members of each of the 8 groups
    assert sorted(np.bincount(mb).tolist()) == [w.group_size // k] * w.unique_images
  assert batch["images"].shape == (8, 32, 32, 3)
  assert (batch["tokens"] == dedup.IMAGE_TOKEN).sum(axis=1).tolist() == [64] * 64


def test_quick_run_writes_json_and_plot(tmp_path):
  result = dedup.run(dedup_config.get_config("quick"), str(tmp_path))
  with open(tmp_path / "dedup.json") as f:
    saved = json.load(f)
  assert saved == json.loads(json.dumps(result))
  assert os.path.getsize(tmp_path / "dedup.png") > 0
  rows, unique = saved["workload"]["rows"], saved["workload"]["unique_images"]
  assert (rows, unique) == (8, 2)
  # Counted by the encoder calls the steps ran: every row (naive) vs the unique images once, and
  # once more in the backward with remat; no reference model (no KL term).
  assert saved["encoder_images_encoded"] == {"naive": 8, "dedup": 2, "dedup_remat": 4}
  assert saved["encoder_images_recomputed"] == {"naive": 0, "dedup": 0, "dedup_remat": 2}
  assert saved["encoder_images_ref"] == {"naive": 0, "dedup": 0, "dedup_remat": 0}
  assert saved["encoder_backward_passes"] == {"naive": 2, "dedup": 1, "dedup_remat": 1}
  assert saved["encoder_images_backward"] == {"naive": 8, "dedup": 2, "dedup_remat": 2}
  # Timings are reported, never judged here (STYLE.md: no timed tests); only their consistency.
  for key in ("naive_s", "dedup_s", "backbone_s", "speedup"):
    assert saved[key] > 0, key
  for key in ("encoder_share_naive", "predicted_speedup"):  # may be negative on a noisy machine
    assert np.isfinite(saved[key]), key
  assert saved["speedup"] == pytest.approx(saved["naive_s"] / saved["dedup_s"])
  # The prediction scales the naive step's encoder time by the counted images, 2 of 8.
  encoder_s = saved["naive_s"] - saved["backbone_s"]
  assert saved["predicted_dedup_s"] == pytest.approx(saved["backbone_s"] + encoder_s * 2 / 8)
  # Same params, same batch: the three paths compute the same loss.
  losses = [p["loss"] for p in saved["paths"].values()]
  np.testing.assert_allclose(losses, losses[0], rtol=1e-5)
