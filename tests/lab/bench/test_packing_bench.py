"""The packing benchmark's quick variant: same rows, fewer token slots, the same first loss."""

import numpy as np

from configs.bench import packing as bench_config
from lab.bench import packing as bench


# Two train-step compiles: ~60 s on two busy cores.
def test_quick_packing_bench_fills_more_and_keeps_the_loss(tmp_path):
  result = bench.run(bench_config.get_config("quick"), str(tmp_path))
  padded, packed = result["layouts"]
  assert padded["useful_tokens"] == packed["useful_tokens"] > 0
  assert packed["loss_tokens"] == padded["loss_tokens"]
  assert packed["token_positions"] < padded["token_positions"] and packed["fill"] > padded["fill"]
  assert packed["sequences"] % 2 == 0  # split evenly into the 2 micro-batches
  np.testing.assert_allclose(packed["first_loss"], padded["first_loss"], rtol=1e-5, atol=1e-7)
  assert result["packed_over_padded"] > 0
  assert (tmp_path / "packing.json").exists() and (tmp_path / "packing.png").exists()
