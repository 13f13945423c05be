"""What the multimodal benchmark runs: its workload points, their FLOPs, and the stored groups.

`workloads` turns ``config.workload`` and ``config.sweep`` (configs/bench/multimodal.py) into
checked `Workload` points; `model_configs` gives each point's decoder and vision encoder;
`row_flops` the forward FLOPs of one row, encoder against decoder. `write_groups` is the rollout
side: it writes a run's groups (one image each) into the storage units and returns each train
step's mini-batches. `lab.bench.multimodal` measures both transfer modes on them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from knitjax.models.transformer import TransformerConfig
from knitjax.models.vision import VisionConfig
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.storage import image_hash
from lab import flops

IMAGE_TOKEN = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """One point: the step's shape, the images, the text lengths (see configs/bench/multimodal.py)."""

  name: str
  group_size: int
  groups_per_step: int
  minibatches: int
  micro_batches: int
  image_size: int
  text_tokens: int
  response_tokens: int
  row_format: str  # the centralized rows' images: "float32" (processor output) or "uint8"
  # When a step's mini-batches are released: "step_start" (when the trainer starts the step) or
  # "pipelined" (when it starts the previous step's last mini-batch: on demand fetches ahead).
  release: str = "step_start"

  @property
  def groups_per_minibatch(self) -> int:
    return self.groups_per_step // self.minibatches


def workloads(config) -> list[Workload]:
  base = dict(config.workload)
  out = [Workload(name="main", **base)]
  for name, overrides in dict(config.sweep).items():
    out.append(Workload(name=name, **{**base, **dict(overrides)}))
  for w in out:
    if w.groups_per_step % w.minibatches or w.groups_per_minibatch % config.consumers:
      raise ValueError(
        f"workload {w.name!r}: {w.groups_per_step} groups per step must split into "
        f"{w.minibatches} mini-batches of a multiple of {config.consumers} consumers' groups."
      )
    if w.release not in ("step_start", "pipelined"):
      raise ValueError(
        f"workload {w.name!r}: release={w.release!r}; accepted: step_start, pipelined."
      )
    if w.row_format not in ("float32", "uint8"):
      raise ValueError(
        f"workload {w.name!r}: row_format={w.row_format!r}; accepted: float32, uint8."
      )
  return out


def model_configs(config, w: Workload) -> tuple[TransformerConfig, VisionConfig]:
  vision = VisionConfig(**{**dict(config.vision), "image_size": w.image_size})
  return TransformerConfig(**dict(config.model)), vision


def row_flops(model: TransformerConfig, vision: VisionConfig, w: Workload) -> dict[str, float]:
  """Forward FLOPs per row (2 x matmul params x tokens + attention scores), encoder vs decoder."""
  tokens = 1 + vision.num_image_tokens + w.text_tokens + w.response_tokens
  dec = flops.decoder_forward_flops(model, tokens)
  enc = flops.encoder_forward_flops(vision, model.d_model)
  return {"encoder": float(enc), "decoder": float(dec), "encoder_share": enc / (enc + dec)}


def write_groups(storage, w: Workload, vision: VisionConfig, steps: int, vocab: int, seed: int):
  """The rollout side: ``steps`` train steps of groups, one image each, written round-robin to
  the storage units. Returns per step its mini-batches (GroupMeta only)."""
  rng = np.random.default_rng(seed)
  g = w.group_size
  plen = 1 + vision.num_image_tokens + w.text_tokens
  out = []
  gid = 0
  for s in range(steps):
    metas = []
    for _ in range(w.groups_per_step):
      image = rng.integers(0, 256, (w.image_size, w.image_size, vision.channels), dtype=np.uint8)
      prompt = np.concatenate(
        [[1], [IMAGE_TOKEN] * vision.num_image_tokens, rng.integers(4, vocab, w.text_tokens)]
      ).astype(np.int32)
      lens = rng.integers(max(1, w.response_tokens // 2), w.response_tokens + 1, g).astype(np.int32)
      mask = np.arange(w.response_tokens)[None] < lens[:, None]
      payload = {
        "prompt_tokens": np.tile(prompt, (g, 1)),
        "response_tokens": rng.integers(4, vocab, (g, w.response_tokens)).astype(np.int32),
        "response_lengths": lens,
        "logprobs": np.where(mask, -rng.exponential(2.0, mask.shape), 0).astype(np.float32),
        "rewards": rng.integers(0, 2, g).astype(np.float32),
        "image_index": np.zeros(g, np.int32),
      }
      unit = gid % len(storage)
      storage[unit].put(gid, payload, images=[image])
      metas.append(
        GroupMeta(
          group_id=gid,
          cls="image",
          gen_version=s,
          num_samples=g,
          prompt_tokens=(plen,) * g,
          response_tokens=tuple(int(x) for x in lens),
          storage_unit=unit,
          image_hashes=(image_hash(image),),
          reward_mean=float(payload["rewards"].mean()),
          reward_std=float(payload["rewards"].std()),
        )
      )
      gid += 1
    k = w.groups_per_minibatch
    out.append([MiniBatch(s, j, tuple(metas[j * k : (j + 1) * k])) for j in range(w.minibatches)])
  return out
