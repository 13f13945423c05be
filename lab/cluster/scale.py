"""The honest scale: which link rate makes an emulated run stand for a named real workload.

A CPU computes about a thousand times slower than the accelerators the paper ran on, so real
link rates would make transfer look free in an emulated run. The emulated multimodal workload
moves real-size payloads (448x448 images, the processor's float32 rows) but computes with a tiny
model on a CPU core. So time is dilated: the named real workload's compute seconds per row
(`real_compute`, from FLOPs, the accelerator's peak and a stated utilisation) against the
emulated run's own compute seconds per row (measured, unshaped) give the dilation

    D = emulated compute per row / real compute per row,

and each emulated link runs at the real link rate / D. The bytes per row are the same in both
(the emulated payloads are real-size), so the emulated run's transfer-to-compute ratio is the
named workload's. The same holds for latency: an emulated link should add the real one-way
latency x D; `latency_shaping` says what that is and whether this kernel could add it.

What the dilation does not carry over: the real step's overlap of compute and host work, the
accelerators' own interconnect, and host-side costs (serialisation, Ray's object store) that
scale with bytes on a CPU as on a real host. The JSON keeps every input so the mapping can be
recomputed for another workload.
"""

from __future__ import annotations

import dataclasses

from lab import flops


@dataclasses.dataclass(frozen=True, kw_only=True)
class RealWorkload:
  """The real workload an emulated run stands for (configs/bench/cluster.py names one).

  Per row (one sampled response with its prompt and one image): ``decoder_params`` see
  ``tokens_per_row`` tokens, ``encoder_params`` see ``patches_per_image`` patches;
  ``train_passes`` forward-equivalents per row (3: forward + backward). The trainer host has
  ``accelerators`` of ``peak_tflops`` each at ``utilisation``; each host's link is
  ``link_gbps``, with ``latency_us`` one-way.
  """

  name: str
  accelerator: str
  peak_tflops: float
  utilisation: float
  accelerators: int
  decoder_params: float
  encoder_params: float
  tokens_per_row: int
  patches_per_image: int
  group_size: int
  train_passes: int = 3
  link_gbps: float = 25.0
  latency_us: float = 10.0

  def __post_init__(self):
    if not 0 < self.utilisation <= 1:
      raise ValueError(f"utilisation={self.utilisation} must be in (0, 1].")
    for f in ("peak_tflops", "accelerators", "decoder_params", "tokens_per_row", "group_size"):
      if not getattr(self, f) > 0:
        raise ValueError(f"RealWorkload.{f}={getattr(self, f)!r} must be > 0.")


def real_compute(w: RealWorkload) -> dict[str, float]:
  """Seconds per row of the real trainer host: every row encoding its image (``naive``, what
  the centralized baseline does) and one encoding per group (``dedup``)."""
  flops_s = w.peak_tflops * 1e12 * w.utilisation * w.accelerators
  decoder = flops.matmul_flops(w.decoder_params, w.tokens_per_row, passes=w.train_passes)
  encoder = flops.matmul_flops(w.encoder_params, w.patches_per_image, passes=w.train_passes)
  return {
    "flops_per_s": flops_s,
    "decoder_flops_per_row": decoder,
    "encoder_flops_per_row": encoder,
    "naive_s": (decoder + encoder) / flops_s,
    "dedup_s": (decoder + encoder / w.group_size) / flops_s,
  }


def dilation(w: RealWorkload, emulated_naive_s_per_row: float) -> dict:
  """The dilation factor and the emulated link rate that keeps the transfer-to-compute ratio.

  Args:
    emulated_naive_s_per_row: the emulated run's measured compute seconds per row with every
      row encoding its image (the centralized mode's, unshaped), on its own trainer core.
  """
  if not emulated_naive_s_per_row > 0:
    raise ValueError(f"emulated compute {emulated_naive_s_per_row} s per row must be > 0.")
  real = real_compute(w)
  factor = emulated_naive_s_per_row / real["naive_s"]
  return {
    "workload": dataclasses.asdict(w),
    "real": real,
    "emulated_naive_s_per_row": emulated_naive_s_per_row,
    "factor": factor,
    "link_mbit": link_mbit(w.link_gbps, factor),
    **latency_shaping(w, factor),
  }


def link_mbit(real_gbps: float, factor: float) -> float:
  """The emulated link rate standing for ``real_gbps`` at dilation ``factor``."""
  return real_gbps * 1000.0 / factor


def latency_shaping(w: RealWorkload, factor: float) -> dict:
  return {"latency_ms_needed": w.latency_us * factor / 1000.0}
