"""The real-size path (issue 35): SmolLM2-135M-Instruct's real weights, generation side by side
with transformers' ``generate``, and the train pass beside a matmul ceiling.

Generation: the same left-padded chat prompts (generated word problems, each rendered with the
checkpoint's chat template), the same batch, every row exactly ``new_tokens`` greedy tokens, in the
same dtype: knitjax's `Sampler` (an end token that never comes) and transformers'
``generate(do_sample=False, eos_token_id=None)`` on the same converted folder, torch given as
many threads as XLA's CPU client uses (the CPUs this process may run on). Each is called once
untimed (knitjax compiles), then rounds alternate knitjax, transformers, knitjax, ...; every round's
seconds and tokens/s are kept, with its ratio (knitjax / transformers tokens/s) and their median.
The greedy tokens of both are compared row by row. Without the ``[parity]`` extra the
transformers rows say so and there is no ratio.

Train pass: knitjax's jitted GRPO step (`lab.bench.mfu.measure_train`: micro-batch scan,
clipped loss, AdamW) on the real weights and random full-length rows, ``rounds`` timed passes after
an untimed one. Achieved FLOP/s = 6 N x trained tokens / s, N = `lab.flops.matmul_params` (every
matmul's params, the tied embedding counted once, as the output projection: 134.5M of SmolLM2's
134.5M); PaLM's count with the attention term is kept beside it. The ceiling is a jitted square
matmul in the train dtype, timed before and after the train pass (median of all its calls).

Usage: python -m lab.bench --config configs/bench/real_model.py[:quick|:gpu] --workdir DIR
"""

from __future__ import annotations

import os
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from knitjax import sharding
from knitjax.config import resolve_init_from
from knitjax.models import hf
from knitjax.models.hf_tokenizer import HFTokenizer
from knitjax.rollout.sampler import Sampler, SamplingConfig
from knitjax.tasks import word_problems
from knitjax.train.batch import left_pad
from lab import flops
from lab.bench import mfu
from lab.bench.report import format_table, write_json

NOT_INSTALLED = "not installed: pip install -e .[parity]"
GENERATION_RATIO_GOAL = 1.5
TRAIN_FRACTION_GOAL = 0.8


def cpu_threads() -> int:
  """The CPUs this process may run on: XLA's CPU client sizes its thread pool by them."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def chat_prompts(tok: HFTokenizer, n: int, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """``n`` generated word problems as chat prompts, left-padded: ``(tokens_bp, lengths_b)``."""
  records = word_problems.generate(n, seed=seed)
  ids = [
    np.asarray(tok.apply_chat_template([{"role": "user", "content": r["question"]}], tokenize=True))
    for r in records
  ]
  return left_pad(ids, max(map(len, ids)), tok.pad_id)


def transformers_generate(
  folder: str, tokens_bp, lengths_b, *, pad_id: int, dtype: str, new_tokens: int
):
  """A call of transformers' greedy ``generate`` (returns the new tokens), or None without the
  ``[parity]`` extra."""
  try:
    import torch
    import transformers
  except ImportError:
    return None
  torch.set_num_threads(cpu_threads())
  device = "cuda" if torch.cuda.is_available() else "cpu"
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
  model = model.to(device).eval()
  width = tokens_bp.shape[1]
  valid = np.arange(width)[None, :] >= (width - lengths_b)[:, None]
  input_ids = torch.tensor(tokens_bp, dtype=torch.long, device=device)
  mask = torch.tensor(valid, dtype=torch.long, device=device)

  def call() -> np.ndarray:
    with torch.inference_mode():
      out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        eos_token_id=None,  # no end token: every row generates new_tokens tokens
        pad_token_id=pad_id,
      )
    return out[:, width:].cpu().numpy()

  call.versions = {"torch": torch.__version__, "transformers": transformers.__version__}
  call.threads = torch.get_num_threads()
  call.device = device
  return call


def agreement(a_bn: np.ndarray, b_bn: np.ndarray) -> dict:
  """Rows whose tokens agree exactly, and the mean length of the agreeing prefix."""
  same = a_bn == b_bn
  prefix = np.where(same.all(1), same.shape[1], np.argmin(same, axis=1))
  return {"rows_agree": float(same.all(1).mean()), "mean_agreeing_prefix": float(prefix.mean())}


def compare_generation(folder: str, mesh, config) -> dict:
  """Alternating rounds of knitjax's sampler and transformers' ``generate``."""
  g = config.generation
  tok = HFTokenizer.from_folder(folder)
  tokens_bp, lengths_b = chat_prompts(tok, g.prompts)
  model, graphdef, params = hf.init_from_hf(folder, mesh, dtype=g.dtype)
  sampler = Sampler(
    graphdef,
    mesh=mesh,
    sampling=SamplingConfig(max_new_tokens=g.new_tokens, temperature=0.0),
    eos_id=model.vocab_size,  # never produced: every row decodes new_tokens tokens
    pad_id=tok.pad_id,
    prompt_len=tokens_bp.shape[1],
  )
  key = jax.random.key(0)
  knitjax_call = lambda: sampler(params, tokens_bp, lengths_b, key).tokens  # noqa: E731
  hf_call = transformers_generate(
    folder, tokens_bp, lengths_b, pad_id=tok.pad_id, dtype=g.dtype, new_tokens=g.new_tokens
  )
  generated = g.prompts * g.new_tokens
  outputs = {"knitjax": knitjax_call()}  # compiles; untimed
  if hf_call is not None:
    outputs["transformers"] = hf_call()  # untimed too, as knitjax's first call is
  rounds = []
  for r in range(config.rounds):
    row = {"round": r}
    for name, call in (("knitjax", knitjax_call), ("transformers", hf_call)):
      if call is None:
        row[f"{name}_s"] = row[f"{name}_tokens_per_s"] = NOT_INSTALLED
        continue
      t0 = time.perf_counter()
      outputs[name] = call()
      row[f"{name}_s"] = time.perf_counter() - t0
      row[f"{name}_tokens_per_s"] = generated / row[f"{name}_s"]
    if hf_call is not None:
      row["ratio"] = row["knitjax_tokens_per_s"] / row["transformers_tokens_per_s"]
    rounds.append(row)
    print(format_table([row], list(row)))
  result = {
    "prompts": g.prompts,
    "prompt_width": int(tokens_bp.shape[1]),
    "new_tokens": g.new_tokens,
    "dtype": g.dtype,
    "generated_tokens_per_call": generated,
    "rounds": rounds,
    "knitjax_tokens_per_s": float(np.median([r["knitjax_tokens_per_s"] for r in rounds])),
  }
  if hf_call is None:
    result.update(transformers=NOT_INSTALLED, transformers_tokens_per_s=NOT_INSTALLED, ratio=None)
    return result
  knit = np.asarray(outputs["knitjax"])
  result.update(
    transformers={**hf_call.versions, "threads": hf_call.threads, "device": hf_call.device},
    transformers_tokens_per_s=float(np.median([r["transformers_tokens_per_s"] for r in rounds])),
    ratio=float(np.median([r["ratio"] for r in rounds])),
    **agreement(knit, outputs["transformers"]),
  )
  return result


def matmul_ceiling(size: int, dtype: str, calls: int) -> list[float]:
  """FLOP/s of ``calls`` timed calls of a jitted ``size``-cubed matmul (after one untimed)."""
  x = jax.random.normal(jax.random.key(0), (size, size), dtype)
  y = jax.random.normal(jax.random.key(1), (size, size), dtype)
  f = jax.jit(jnp.matmul)
  _, times = mfu.timed(lambda: f(x, y), warmup=0, steps=calls)
  return [2.0 * size**3 / t for t in times]


def measure_train_pass(folder: str, mesh, config) -> dict:
  """The train pass's rounds beside the matmul ceiling measured around it."""
  t = config.train
  if t.seq_len <= t.prompt_len:
    raise ValueError(f"train.seq_len={t.seq_len} must exceed train.prompt_len={t.prompt_len}.")
  model, graphdef, params = hf.init_from_hf(folder, mesh, dtype=t.dtype)
  ceiling = matmul_ceiling(config.ceiling.size, t.dtype, config.ceiling.calls)
  # The fields measure_train reads: config.train's, the timed steps and the stated peak.
  view = types.SimpleNamespace(**t.to_dict(), steps=config.rounds, peak_tflops=config.peak_tflops)
  train = mfu.measure_train(model, mesh, view, t.seq_len, weights=(graphdef, params))
  ceiling += matmul_ceiling(config.ceiling.size, t.dtype, config.ceiling.calls)
  ceiling_flops = float(np.median(ceiling))
  n = flops.matmul_params(model)
  tokens = t.rows * t.seq_len
  trained = flops.matmul_flops(n, tokens, passes=flops.TRAIN_PASSES)  # 6 N x tokens
  rounds = [
    {
      "round": r,
      "pass_s": s,
      "tokens_per_s": tokens / s,
      "gflops_per_s": trained / s / 1e9,
      "fraction_of_ceiling": trained / s / ceiling_flops,
    }
    for r, s in enumerate(train["step_s_all"])
  ]
  print(format_table(rounds, list(rounds[0])))
  achieved = trained / train["step_s"]
  return {
    "rows": t.rows,
    "seq_len": t.seq_len,
    "micro_batches": t.micro_batches,
    "dtype": t.dtype,
    "optimizer": "adamw",
    "params_counted": n,
    "flops_counted_as": "6 x params_counted x rows x seq_len (lab.flops.matmul_params)",
    "rounds": rounds,
    "pass_s": train["step_s"],
    "gflops_per_s": achieved / 1e9,
    "ceiling_gflops_per_s": ceiling_flops / 1e9,
    "ceiling_gflops_per_s_all": [f / 1e9 for f in ceiling],
    "ceiling_matmul": f"{config.ceiling.size}^3 {t.dtype}, jitted",
    "fraction_of_ceiling": achieved / ceiling_flops,
    "palm_tflops_per_s": train["tflops_per_s"],  # 6 N + 12 L H Q T, as configs/bench/mfu.py
    "mfu": train["mfu"],
    "compile_s": train["compile_s"],
    "first_call_s": train["first_call_s"],
    "peak_bytes": train["peak_bytes"],
  }


def environment() -> dict:
  """Versions, device and threads; the load average says whether the machine was quiet."""
  return {
    "load_average_1m": os.getloadavg()[0],
    "jax_version": jax.__version__,
    "backend": jax.default_backend(),
    "device_kind": jax.devices()[0].device_kind,
    "cpu_count": os.cpu_count(),
    "threads": cpu_threads(),
  }


def run(config, workdir: str) -> dict:
  if config.rounds < 1:
    raise ValueError(f"rounds={config.rounds} must be >= 1.")
  folder = resolve_init_from(config.init_from)
  env = environment()  # before the run: its load average is other work's
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  generation = compare_generation(folder, mesh, config)
  train = measure_train_pass(folder, mesh, config)
  ratio, fraction = generation["ratio"], train["fraction_of_ceiling"]
  result = {
    "config": config.to_dict(),
    "model": folder,
    "environment": env,
    "generation": generation,
    "train": train,
    "goals": {
      "generation_ratio_goal": GENERATION_RATIO_GOAL,
      "generation_ratio": ratio,
      "generation_goal_met": None if ratio is None else ratio >= GENERATION_RATIO_GOAL,
      "train_fraction_goal": TRAIN_FRACTION_GOAL,
      "train_fraction": fraction,
      "train_goal_met": fraction >= TRAIN_FRACTION_GOAL,
    },
  }
  write_json(workdir, "real_model", result)
  _plot(workdir, generation, train)
  print(format_table([result["goals"]], list(result["goals"])))
  return result


def _plot(workdir: str, generation: dict, train: dict) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
  for name in ("knitjax", "transformers"):
    values = [r[f"{name}_tokens_per_s"] for r in generation["rounds"]]
    if all(isinstance(v, float) for v in values):
      left.plot(range(len(values)), values, "o-", label=name)
  left.set_xlabel("round")
  left.set_ylabel("generated tokens / s")
  left.set_title(f"{generation['prompts']} prompts x {generation['new_tokens']} greedy tokens")
  left.legend()
  rounds = train["rounds"]
  left.set_xticks(range(len(rounds)))
  right.bar(range(len(rounds)), [r["gflops_per_s"] for r in rounds])
  right.set_xticks(range(len(rounds)))
  right.axhline(train["ceiling_gflops_per_s"], color="k", ls="--", label="matmul ceiling")
  right.set_xlabel("round")
  right.set_ylabel("GFLOP/s (6 N x tokens)")
  right.set_title(f"train pass, {train['rows']} x {train['seq_len']} tokens")
  right.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "real_model.png"), dpi=120)
  plt.close(fig)
