"""Seconds per full GRPO step (rollout + reward + transfer + log-probs + update), colocated.

Usage: python -m lab.bench --config configs/bench/step_time.py --workdir DIR

Side by side with Tunix 0.1.7 (installed in a throwaway venv, lab/bench/external/README.md):
  python3 -m venv /tmp/tunix-venv && /tmp/tunix-venv/bin/pip install google-tunix==0.1.7
  python -m lab.bench --config configs/bench/step_time.py --workdir DIR \
    --config.baseline_python=/tmp/tunix-venv/bin/python --config.rounds=3

Shape (issue 2, the shape Tunix 0.1.7 was measured on): a Qwen3-style decoder with 2 layers,
d_model 128, ffn 256, 4 heads x 32, 2 KV heads, vocab 256, tied embeddings, q/k-norm; 4 prompts x
G=4 = 16 sequences; prompts left-padded to 8 tokens; 32 new tokens; one mini-batch (one AdamW
update) per step; a reference-model forward for the k3 KL term (kl_coef 0.04, Tunix's default
beta); 2 fake CPU devices, batch-sharded. The first `warmup_steps` steps (compilation) are excluded.
"""

import ml_collections

from configs import arith_tiny, common


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.bench = "step_time"
  c.cpu_devices = 2
  c.warmup_steps = 5
  c.rounds = 1  # rounds of (baseline, knitjax) back to back; the headline is the median round
  c.baseline_python = ""  # a venv python with the external system; empty: knitjax alone
  c.baseline_script = "lab/bench/external/tunix_step_time.py"
  run = arith_tiny.get_config()
  run.model = common.tiny_decoder(vocab_size=256, d_model=128, head_dim=32, ffn_dim=256)
  run.task.prompt_len = 8
  run.rollout = dict(group_size=4, max_new_tokens=32, temperature=1.0)
  run.loss.kl_coef = 0.04
  run.admission = dict(policy="minibatch", quotas={"arith": 4}, minibatches=1)
  run.loop.steps = 45
  run.loop.log_every = 10
  run.checkpoint.every_steps = 1000  # only the final save, after the timed steps
  run.mesh = dict(shape=(-1, 1, 1), cpu_devices=2)
  c.run = run
  if arg == "quick":
    c.run.loop.steps = 4
    c.warmup_steps = 2
  elif arg not in (None, ""):
    raise ValueError(f"unknown variant {arg!r} of configs/bench/step_time.py; choose: quick.")
  return c
