"""FLOPs, counted in one place: PaLM's count by hand, and every shipped config's numbers pinned.

The pinned numbers are what the four counts gave before they became `lab.flops` (the MFU
benchmark, the multimodal workload's rows, the emulated cluster's scale and the real-model
bench's 6 N), so moving the arithmetic changed none of them.
"""

import pytest

from configs.bench import cluster as cluster_config
from configs.bench import mfu as mfu_config
from configs.bench import multimodal as mm_config
from knitjax.models.transformer import TransformerConfig
from lab import flops
from lab.bench import multimodal_workload
from lab.cluster import scale


def test_flops_per_token_follow_palm():
  model = TransformerConfig(
    vocab_size=100, num_layers=2, d_model=8, num_heads=4, num_kv_heads=2, head_dim=2, ffn_dim=16
  )
  # Per layer: q 8x4x2, k and v 8x2x2 each, o 4x2x8, MLP 3 x 8x16; plus the 8x100 unembedding.
  per_layer = 64 + 32 + 32 + 64 + 384
  n = 2 * per_layer + 800
  assert flops.matmul_params(model) == n
  # 6 N + 12 L H Q T at T = 10: three forwards of 2 N + 4 L H Q T each.
  assert flops.train_flops_per_token(model, 10) == 6 * n + 12 * 2 * 4 * 2 * 10
  assert flops.decoder_forward_flops(model, 10) == 2 * n * 10 + 4 * 2 * 4 * 2 * 10**2
  assert flops.train_flops_per_token(model, 10) * 10 == 3 * flops.decoder_forward_flops(model, 10)


@pytest.mark.parametrize(
  "arg, params, per_token",
  [
    (None, 493961216, [2967896064.0, 3095887872.0, 3492249600.0, 4020731904.0]),
    ("quick", 20480, [135168.0, 516096.0, 1695744.0, 3268608.0]),
  ],
)
def test_the_mfu_shapes_count_as_before(arg, params, per_token):
  model = TransformerConfig(**mfu_config.get_config(arg).model)
  assert flops.matmul_params(model) == params
  assert [flops.train_flops_per_token(model, t) for t in (16, 512, 2048, 4096)] == per_token
  # the real-model bench's 6 N x tokens
  assert flops.matmul_flops(params, 8 * 512, passes=flops.TRAIN_PASSES) == 6 * params * 8 * 512


@pytest.mark.parametrize(
  "arg, name, decoder, encoder",
  [
    (None, "main", 615318528.0, 456130560.0),
    (None, "image224", 287769600.0, 101449728.0),
    (None, "long_response", 1496908800.0, 456130560.0),
    ("quick", "main", 979200.0, 753664.0),
  ],
)
def test_the_multimodal_rows_count_as_before(arg, name, decoder, encoder):
  c = mm_config.get_config(arg)
  (w,) = [w for w in multimodal_workload.workloads(c) if w.name == name]
  model, vision = multimodal_workload.model_configs(c, w)
  row = multimodal_workload.row_flops(model, vision, w)
  assert row == {
    "decoder": decoder,
    "encoder": encoder,
    "encoder_share": encoder / (encoder + decoder),
  }


def test_the_named_real_workload_counts_as_before():
  real = scale.real_compute(scale.RealWorkload(**dict(cluster_config.get_config().real)))
  assert real["decoder_flops_per_row"] == 7137900000000.0
  assert real["encoder_flops_per_row"] == 4116480000000.0
  assert real["flops_per_s"] == 3164800000000000.0
