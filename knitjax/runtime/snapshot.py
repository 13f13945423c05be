"""Payload snapshots of a storage unit, for checkpoints of the disaggregated runtime.

Groups that were offered but not consumed when a checkpoint is taken (pending in the admission
index, or released and queued for the trainer) have their payloads only in memory. The
checkpoint keeps them, so a resumed run holds exactly the groups its admission state names: none
lost, none consumed twice. Groups still generating are not offered yet and are regenerated.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

import numpy as np

from knitjax.transfer.storage import StorageUnit

_FIELDS = (
  "prompt_tokens",
  "prompt_lengths",
  "response_tokens",
  "response_lengths",
  "logprobs",
  "rewards",
)


def snapshot_groups(storage: StorageUnit, group_ids: Sequence[int]) -> dict:
  """The payloads of ``group_ids`` as a JSON-able dict (one base64 ``.npz``)."""
  ids = [int(g) for g in group_ids]
  arrays = {}
  if ids:
    got = storage.get(ids, _FIELDS)
    for f in _FIELDS:
      for gid, a in zip(ids, got[f], strict=True):
        arrays[f"{gid}/{f}"] = a
  buf = io.BytesIO()
  np.savez_compressed(buf, **arrays)
  return {"group_ids": ids, "npz": base64.b64encode(buf.getvalue()).decode("ascii")}


def restore_groups(storage: StorageUnit, snap: dict) -> int:
  """Puts the snapshot's groups back into ``storage`` (inputs as first put); returns the count."""
  data = np.load(io.BytesIO(base64.b64decode(snap["npz"])))
  for gid in snap["group_ids"]:
    a = {f: data[f"{gid}/{f}"] for f in _FIELDS}
    prompts = [row[:n] for row, n in zip(a["prompt_tokens"], a["prompt_lengths"], strict=True)]
    storage.put(
      gid,
      {
        "prompt_tokens": prompts,
        "response_tokens": a["response_tokens"],
        "response_lengths": a["response_lengths"],
        "logprobs": a["logprobs"],
        "rewards": a["rewards"],
      },
    )
  return len(snap["group_ids"])
