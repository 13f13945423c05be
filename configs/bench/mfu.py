"""Train-step MFU and sampler tokens/s at the Qwen2.5-0.5B shape (random weights).

Usage: python -m lab.bench --config configs/bench/mfu.py --workdir DIR        # one H200
       python -m lab.bench --config configs/bench/mfu.py:cpu --workdir DIR    # reduced, CPU
       python -m lab.bench --config configs/bench/mfu.py:quick --workdir DIR  # tests

Default (one H200, lab/scripts/device/h200.sh): Qwen2.5-0.5B (24 layers, d_model 896, 14 heads x
64, 2 KV heads, ffn 4864, vocab 151936, q/k/v bias, tied), bf16 compute over float32 params and
AdamW state, layers scanned with block remat; train rows of 2048 and 4096 tokens (512 prompt),
16 rows per step in 4 micro-batches; peak 989 TFLOP/s (H200 SXM dense bf16). Sampler: 128 rows,
256-token prompts, 256 new tokens. ``:cpu`` keeps the structure at a size 2 CPU cores run in a few
minutes (4 layers, d_model 256, vocab 8192, rows of 256 and 512 tokens); no peak is stated there,
so MFU is null and only FLOP/s are reported.
"""

import ml_collections

QWEN25_05B = dict(
  vocab_size=151936,
  num_layers=24,
  d_model=896,
  num_heads=14,
  num_kv_heads=2,
  head_dim=64,
  ffn_dim=4864,
  rope_theta=1000000.0,
  norm_eps=1e-6,
  tie_embeddings=True,
  qkv_bias=True,
  dtype="bfloat16",
  scan_layers=True,
  remat="block",
)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.bench = "mfu"
  c.cpu_devices = 1
  c.devices = 1
  c.mesh_shape = (1, 1, 1)
  c.model = dict(QWEN25_05B)
  c.seq_lens = (2048, 4096)
  c.prompt_len = 512
  c.rows = 16
  c.micro_batches = 4
  c.warmup = 1
  c.steps = 5
  c.peak_tflops = 989.0  # per device: H200 SXM, dense bf16
  c.sampler = dict(batch=128, prompt_len=256, new_tokens=256)
  if arg == "cpu":
    c.model.update(num_layers=4, d_model=256, num_heads=4, num_kv_heads=2, ffn_dim=1024,
                   vocab_size=8192, dtype="float32")  # fmt: skip
    c.seq_lens, c.prompt_len, c.rows, c.micro_batches = (256, 512), 64, 8, 2
    c.steps, c.peak_tflops = 3, 0.0
    c.sampler = dict(batch=8, prompt_len=32, new_tokens=32)
  elif arg == "quick":
    c.model.update(num_layers=2, d_model=32, num_heads=2, num_kv_heads=1, head_dim=16,
                   ffn_dim=64, vocab_size=64, dtype="float32")  # fmt: skip
    c.seq_lens, c.prompt_len, c.rows, c.micro_batches = (16,), 4, 4, 2
    c.warmup, c.steps, c.peak_tflops = 0, 2, 0.0
    c.sampler = dict(batch=2, prompt_len=4, new_tokens=4)
  elif arg not in (None, ""):
    raise ValueError(f"unknown variant {arg!r} of configs/bench/mfu.py; choose: cpu, quick.")
  return c
