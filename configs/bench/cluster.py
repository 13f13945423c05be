"""The paper's claims across an emulated cluster: hosts as network namespaces, shaped links,
their own cores (lab/bench/cluster.py, docs/cluster.md). Needs root and iproute2.

    python -m lab.bench --config configs/bench/cluster.py --workdir runs/cluster
    python -m lab.bench --config configs/bench/cluster.py:quick --workdir /tmp/clq

Hosts: 0 the trainer (core 0, the Ray head), 1 the storage units, 2 the controller (the
centralized baseline's driver); 1 and 2 share core 1. The named real workload: Qwen2.5-VL-3B
(a 3.09B decoder, a 0.67B ViT) trained with GRPO on one host of 8 H100s (989 dense bf16 TFLOP/s
each) at 40% utilisation; rows shaped like the multimodal benchmark's main workload (one 448x448
image = 1,024 patches, 256 image tokens + 33 prompt tokens + 96 response tokens on average,
G = 8); 25 Gb/s per host, 10 us one way. ``quick`` runs the multimodal smoke workload (56x56
images): it checks the harness, its dilation means nothing.

``trainer_hosts``: the same comparison with T trainer processes, one per trainer host, one JAX
program (docs/cluster.md, "Trainer hosts T = 1, 2, 4"); only those runs:

    python -m lab.bench --config configs/bench/cluster.py --workdir runs/cluster_hosts \
      --config.one_trainer_host=False --config.staleness_variant=""
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.bench = "cluster"
  c.host_cores = ((0,), (1,), (1,))
  c.real = dict(
    name="Qwen2.5-VL-3B GRPO, one 8xH100 trainer host",
    accelerator="H100 SXM, dense bf16",
    peak_tflops=989.0,
    utilisation=0.4,
    accelerators=8,
    decoder_params=3.09e9,
    encoder_params=0.67e9,
    tokens_per_row=1 + 256 + 32 + 96,
    patches_per_image=1024,
    group_size=8,
    train_passes=3,
    link_gbps=25.0,
    latency_us=10.0,
  )
  c.multimodal_variant = "cluster"
  c.repeats = 2  # runs at the real link rate
  c.sweep_gbps = (5.0, 10.0, 50.0, 100.0)  # one run each
  c.run_timeout_s = 900
  # The one-trainer-host runs above (calibration, repeats, sweep); False: only the T runs below.
  c.one_trainer_host = True
  # The multimodal comparison with T trainer hosts, one process each, one JAX program
  # (lab/bench/multimodal_hosts.py): every T of trainer_hosts, each calibrated on its own (the
  # dilation per host), then trainer_host_rounds rounds at the real link rate; () = skip.
  # Hosts: 0 trainer 0, 1 storage, 2 controller, 3.. trainers 1..; the trainers share
  # host_cores[0], storage and controller host_cores[1].
  c.trainer_hosts = (1, 2, 4)
  c.trainer_host_rounds = 2
  # The staleness grid and learning (configs/bench/staleness_real.py:<variant>, "" = skip),
  # with these extra flags.
  c.staleness_variant = "paper"
  c.staleness_flags = ()
  # Read the runs already finished in the workdir (after a failure or to judge them again)
  # instead of running them again.
  c.reuse_runs = False
  if arg == "quick":
    c.multimodal_variant = "cluster_quick"
    c.repeats = 1
    c.sweep_gbps = (100.0,)
    c.run_timeout_s = 300
    c.staleness_variant = ""  # the grid takes half an hour; run it with the full variant
    c.trainer_hosts = ()
    c.trainer_host_rounds = 1
  elif arg not in (None, ""):
    raise ValueError(f"unknown variant {arg!r} of configs/bench/cluster.py; choose: quick.")
  return c
