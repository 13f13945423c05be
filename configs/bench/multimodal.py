"""Multimodal transfer + training: centralized baseline vs on-demand access with encoder dedup.

Usage:
  python -m lab.bench --config configs/bench/multimodal.py --workdir DIR
  python -m lab.bench --config configs/bench/multimodal.py:quick --workdir DIR   # smoke

One run, both modes side by side (lab/bench/multimodal.py): local Ray, 2 storage-unit
actors, 2 consumers (threads of the trainer process, one per data-parallel shard of a 2-device
train mesh), a driver actor for the centralized baseline.

Main workload, shaped like a small VLM (Qwen2.5-VL-3B-like ratios, scaled to a CPU):
- images 448x448x3 uint8 as stored (602 KB); the centralized driver hands each row the
  processor's float32 pixel array (2.4 MB), as single-controller systems pass per-sample
  pixel values; 28x28 patches -> 256 image tokens per image (Qwen2.5-VL: 1,024 patches of 14
  merged 2x2 into 256 tokens for a 448x448 image);
- G = 8; 4 groups per step in 2 mini-batches (2 micro-batches each), one image per group;
- text: 32 prompt tokens besides the image, responses of 64-128 tokens (short answers);
- encoder SigLIP-style 2 layers d_model 128 + projector; decoder 2 layers d_model 128: the
  encoder's share of a row's forward FLOPs is 43% (row_flops in the JSON), Qwen2.5-VL-3B's is
  about 37% with 128-token answers and 15% with 1,024-token ones (a 0.67B ViT on 1,024 patches
  beside a 3B decoder on 256 + text tokens).
A step's mini-batches are released when the trainer starts the step (rollout ahead of training;
the conservative choice for on demand, whose first fetch of a step is then exposed).
Sweep (each a change of the main workload): G 16, 224x224 images, 512-token responses, uint8
rows (the driver sends stored bytes instead of the processor's floats), and pipelined release
(a step's mini-batches complete while the previous step trains, as minibatch admission makes
them in a disaggregated run: on demand fetches the next step's first mini-batch ahead; the
centralized driver still gathers when the step starts).
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.bench = "multimodal"
  c.cpu_devices = 2
  c.seed = 0
  c.consumers = 2
  c.storage_units = 2
  c.warmup = 1
  c.steps = 3
  c.bandwidths_gbps = (25.0, 100.0)
  # Placement in a Ray cluster (the emulated cluster, configs/bench/cluster.py, sets them):
  # its address, the node IPs the storage units go to (comma-separated, round-robin) and the
  # centralized driver's node IP; "" = a local Ray, placed by Ray.
  c.ray_address = ""
  c.unit_nodes = ""
  c.driver_node = ""
  c.workload = dict(
    group_size=8,
    groups_per_step=4,
    minibatches=2,
    micro_batches=2,
    image_size=448,
    text_tokens=32,
    response_tokens=128,
    row_format="float32",
    release="step_start",
  )
  c.vision = dict(
    image_size=448,
    patch_size=28,
    channels=3,
    d_model=128,
    num_layers=2,
    num_heads=4,
    head_dim=32,
    mlp_dim=512,
    projector_dim=256,
  )
  c.model = dict(
    vocab_size=256,
    num_layers=2,
    d_model=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    ffn_dim=512,
    qk_norm=True,
  )
  c.sweep = dict(
    g16=dict(group_size=16),
    image224=dict(image_size=224),
    long_response=dict(response_tokens=512),
    uint8_rows=dict(row_format="uint8"),
    pipelined=dict(release="pipelined"),
  )
  if arg == "cluster":  # the emulated cluster: the main workload, released as each regime does
    c.sweep = dict(pipelined=dict(release="pipelined"))
  if arg in ("quick", "cluster_quick"):
    c.warmup = 1
    c.steps = 1
    c.workload.update(image_size=56, group_size=4, text_tokens=4, response_tokens=8)
    c.vision.update(image_size=56, d_model=32, head_dim=8, mlp_dim=64, projector_dim=32)
    c.model.update(d_model=32, head_dim=8, ffn_dim=64)
    c.sweep = dict(g8=dict(group_size=8))
    if arg == "cluster_quick":
      c.sweep = dict()
  elif arg not in (None, "", "cluster"):
    raise ValueError(
      f"unknown variant {arg!r} of configs/bench/multimodal.py; choose: quick, cluster, "
      "cluster_quick."
    )
  return c
