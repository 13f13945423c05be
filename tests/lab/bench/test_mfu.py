"""The MFU benchmark: its model shape's size, and a quick run's JSON."""

import json

import jax
import pytest

from configs.bench import mfu as bench_config
from knitjax.models.transformer import TransformerConfig
from lab import flops
from lab.bench import mfu


def test_the_qwen25_05b_shape_has_its_published_size():
  model = TransformerConfig(**bench_config.get_config().model)
  # Qwen2.5-0.5B: 0.49B params, 0.36B of them outside the (tied) embedding.
  non_embedding = flops.matmul_params(model) - model.vocab_size * model.d_model
  assert 0.35e9 < non_embedding < 0.37e9


def test_quick_run_reports_throughput_and_no_mfu_without_a_peak(tmp_path):
  c = bench_config.get_config("quick")
  result = mfu.run(c, str(tmp_path))
  (train,) = result["train"]
  assert train["tokens_per_s"] == pytest.approx(c.rows * 16 / train["step_s"])
  assert train["mfu"] is None and train["tflops_per_s"] > 0
  assert train["peak_bytes"] > 0
  # Every sampled row decodes all its new tokens (the end token is never drawn).
  assert result["sampler"]["generated_tokens"] == 2 * 4
  assert result["backend"] == jax.default_backend()
  saved = json.loads((tmp_path / "mfu.json").read_text())
  assert saved["train"][0]["seq_len"] == 16
  assert (tmp_path / "mfu.png").exists()
  # With a stated peak, MFU is the achieved FLOP/s over it.
  c.peak_tflops = 1e-3
  train = mfu.run(c, str(tmp_path))["train"][0]
  assert train["mfu"] == pytest.approx(train["tflops_per_s"] / 1e-3)
