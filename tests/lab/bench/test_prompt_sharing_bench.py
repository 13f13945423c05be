"""The prompt-sharing benchmark's quick variant: a complete JSON whose token counts are the
formula's and whose two layouts start from the same loss."""

import json

import numpy as np
import pytest

from configs.bench import prompt_sharing as bench_config
from lab.bench import prompt_sharing as bench

POINT_KEYS = {
  "model", "prompt_len", "response_len", "group_size", "token_ratio", "tokens_off",
  "tokens_group", "positions_off", "positions_group", "step_s_off", "step_s_group", "rounds",
  "speedup", "speedup_over_ratio", "loss_off", "loss_group", "memory",
}  # fmt: skip


def test_token_ratio_formula():
  assert bench.token_ratio(32, 32, 8) == pytest.approx(8 * 64 / (32 + 8 * 32))
  assert bench.token_ratio(0, 7, 16) == 1.0  # no prompt: nothing to share
  assert bench.score_ratio(2048, 512, 8) == pytest.approx(8 * 2560**2 / (2048**2 + 8 * 512 * 4608))
  assert bench.score_ratio(0, 7, 16) == 1.0


# Four train-step compiles of the tiny decoder: ~30 s on two busy cores.
def test_quick_bench_writes_points_with_exact_ratios_and_equal_losses(tmp_path):
  config = bench_config.get_config("quick")
  result = bench.run(config, str(tmp_path))
  saved = json.loads((tmp_path / "prompt_sharing.json").read_text())
  assert saved["points"] == result["points"]
  assert (tmp_path / "prompt_sharing.png").stat().st_size > 0
  assert {"backend", "devices", "models"} <= set(saved)
  assert len(saved["points"]) == len(config.group_sizes) * len(config.prompt_ratios) == 1
  for p in saved["points"]:
    assert set(p) >= POINT_KEYS
    g, pl, rl, k = p["group_size"], p["prompt_len"], p["response_len"], p["groups"]
    assert p["token_ratio"] == pytest.approx(g * (pl + rl) / (pl + g * rl), rel=1e-12)
    assert (p["tokens_off"], p["tokens_group"]) == (k * g * (pl + rl), k * (pl + g * rl))
    # Equal lengths fill every position of either layout.
    assert (p["positions_off"], p["positions_group"]) == (p["tokens_off"], p["tokens_group"])
    np.testing.assert_allclose(p["loss_group"], p["loss_off"], rtol=1e-5, atol=1e-7)
    assert p["loss_off"] != 0
    assert len(p["rounds"]) == config.repeats and all(t > 0 for r in p["rounds"] for t in r)
    assert p["speedup"] == pytest.approx(p["rounds"][0][0] / p["rounds"][0][1])
    assert p["speedup_over_ratio"] == pytest.approx(p["speedup"] / p["token_ratio"])
    for layout in ("off", "group"):
      assert p["memory"][layout]["peak_bytes"] >= p["memory"][layout]["temp_bytes"] > 0
  # A prompt of 4 R shares: less scratch memory than its padded rows.
  (point,) = saved["points"]
  assert point["token_ratio"] > 2
  assert point["memory"]["group"]["temp_bytes"] < point["memory"]["off"]["temp_bytes"]


# Two train-step compiles of the tiny decoder: ~20 s on two busy cores.
def test_prefix_point_counts_its_tokens_and_starts_from_the_padded_loss(tmp_path):
  """``:prefix_quick``: prompts once per mini-batch against padded rows, a group's rows over 2
  micro-batches: its tokens are ``P - 1 + G R``, its first loss the padded one."""
  config = bench_config.get_config("prefix_quick")
  (p,) = bench.run(config, str(tmp_path))["points"]
  g, pl, rl = p["group_size"], p["prompt_len"], p["response_len"]
  assert (p["micro_batches_per_group"], p["micro_batches"]) == (2, 2)
  assert (p["tokens_off"], p["tokens_prefix"]) == (g * (pl + rl), pl - 1 + g * rl)
  np.testing.assert_allclose(p["loss_prefix"], p["loss_off"], rtol=1e-5, atol=1e-7)
  assert p["memory"]["prefix"]["peak_bytes"] >= p["memory"]["prefix"]["temp_bytes"] > 0
  assert p["speedup"] == pytest.approx(p["rounds"][0][0] / p["rounds"][0][1])


def test_unknown_variant_is_named():
  with pytest.raises(ValueError, match="choose: quick"):
    bench_config.get_config("slow")
