"""The multimodal benchmark's workload points: their FLOPs and their checks."""

import pytest

from configs.bench import multimodal as mm_config
from lab.bench import multimodal_workload


def test_row_flops_share_of_the_main_workload_is_stated():
  c = mm_config.get_config()
  w = multimodal_workload.workloads(c)[0]
  model, vision = multimodal_workload.model_configs(c, w)
  flops = multimodal_workload.row_flops(model, vision, w)
  assert vision.num_image_tokens == 256  # 448 / 28 squared, like Qwen2.5-VL's merged tokens
  assert 0.3 < flops["encoder_share"] < 0.5  # the config's docstring says 43%


def test_bad_workload_is_one_clear_error():
  c = mm_config.get_config("quick")
  c.workload.groups_per_step = 3
  with pytest.raises(ValueError, match="must split into 2 mini-batches"):
    multimodal_workload.workloads(c)
