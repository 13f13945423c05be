"""Train-step speedup of shared prompts over padded rows, against the token ratio.

Usage: python -m lab.bench --config configs/bench/prompt_sharing.py --workdir DIR
       python -m lab.bench --config configs/bench/prompt_sharing.py:quick --workdir DIR

Workload per point: a mini-batch of groups (arith: 32, as configs/arith_tiny.py's; smollm2: 8,
as configs/smollm2_learn.py's) of G responses, each group one random prompt of exactly P tokens
and responses of exactly R tokens (the token ratio G (P + R) / (P + G R) is then exact), random
behaviour log-probs, GRPO advantages of random 0/1 rewards; AdamW, a k3 KL term (kl_coef 0.04)
against a reference policy (the reference forward is in the step), 2 micro-batches, one CPU
device. Points: P / R in {0.25, 1, 4} x G in {8, 16} for two model shapes: "arith"
(configs/arith_tiny.py's decoder, vocab 16, R = 32: P = 8, 32, 128) and "smollm2" (SmolLM2-135M's
shape, vocab 49152, d_model 576, 9 heads x 64, 3 KV heads, ffn 1536, tied embeddings, but 2 of
its 30 layers: the ratio measures per-layer work; ``--config.models.smollm2.model.num_layers=30``
for the whole depth; R = 16: P = 4, 16, 64). 3 alternating rounds a point after a warm-up step.
``:quick`` is the arith shape at one small point (P = 4R, G = 4), 1 round, for tests.

``:prefix`` measures prompts once per mini-batch (``layout.prompt_sharing="prefix"``) against
padded rows: P in {256, 2048} x R in {512, 2048} x G in {8, 16}, one group a mini-batch whose
rows span ``micro_batches_per_group`` micro-batches (2 for G = 8, 4 for G = 16: 4 rows a
micro-batch), arith's decoder (2 layers, d_model 64), 2 rounds a point. ``:prefix_quick``: one
small point, 1 round, for tests.
"""

import ml_collections

from configs import common
from configs.bench.lora_memory import SMOLLM2_135M


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.bench = "prompt_sharing"
  c.cpu_devices = 1
  c.devices = 1
  c.mesh_shape = (1, 1, 1)
  c.seed = 0
  c.group_sizes = (8, 16)
  c.prompt_ratios = (0.25, 1.0, 4.0)  # P / R
  c.models = dict(
    # groups: a mini-batch's, as the recipes have it (arith_tiny: 32 prompts a mini-batch;
    # smollm2_learn: 8), so the step's per-token work weighs as in a run next to its fixed
    # costs (the optimizer update, the table-sized gradients of a 49k vocabulary).
    arith=dict(model=common.tiny_decoder(vocab_size=16), response_len=32, groups=32),
    smollm2=dict(model=dict(SMOLLM2_135M, num_layers=2), response_len=16, groups=8),
  )
  c.micro_batches = 2
  c.repeats = 3
  c.kl_coef = 0.04
  c.optimizer = dict(lr=1e-5, warmup_steps=0, weight_decay=0.0, b1=0.9, b2=0.999, grad_clip=1.0)
  c.goal = 0.85  # speedup / token ratio
  if arg == "quick":
    c.models = dict(arith=dict(model=common.tiny_decoder(vocab_size=16), response_len=4, groups=2))
    c.group_sizes, c.prompt_ratios, c.repeats = (4,), (4.0,), 1
  elif arg in ("prefix", "prefix_quick"):
    c.layouts = ("off", "prefix")
    c.group_sizes, c.prompt_ratios = (), ()
    # (P, R, G, micro_batches_per_group)
    c.points = tuple((p, r, g, g // 4) for p in (256, 2048) for r in (512, 2048) for g in (8, 16))
    c.models = dict(arith=dict(model=common.tiny_decoder(vocab_size=16), response_len=0, groups=1))
    c.repeats = 2
    if arg == "prefix_quick":
      c.points, c.repeats = ((8, 4, 4, 2),), 1
  elif arg not in (None, ""):
    raise ValueError(
      f"unknown variant {arg!r} of configs/bench/prompt_sharing.py; choose: quick, prefix, "
      "prefix_quick."
    )
  return c
