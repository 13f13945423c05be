"""Payload snapshots of storage units, for checkpoints of the disaggregated runtime.

Groups that were offered but not consumed when a checkpoint is taken (pending in the admission
index, or released and queued for the trainer) have their payloads only in memory. The
checkpoint keeps them, so a resumed run holds exactly the groups its admission state names: none
lost, none consumed twice. Groups still generating are not offered yet and are regenerated.

A snapshot is JSON-able: the groups (id, storage unit, image hashes in the group's image order)
and one base64 ``.npz`` of every payload's arrays (``GroupPayload.to_arrays``, so every field,
optional ones and a ``response_mask`` with holes included) and each image once, by content hash.
"""

from __future__ import annotations

import base64
import io
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from knitjax.transfer.group import GroupMeta
from knitjax.transfer.payload import GroupPayload
from knitjax.transfer.storage import StorageUnit


def snapshot_groups(storage: Mapping[int, StorageUnit], metas: Sequence[GroupMeta]) -> dict:
  """The payloads and images of these groups, from the units holding them, as a JSON-able dict.

  Args:
    storage: the storage units by id.
    metas: the groups to keep; each is read from ``storage[meta.storage_unit]``.

  Raises:
    ValueError: a group id repeats.
    KeyError: a group or image is not held by its unit.
  """
  ids = [m.group_id for m in metas]
  if len(set(ids)) != len(ids):
    raise ValueError(f"snapshot_groups got repeated group ids in {ids}; accepted: unique ids.")
  by_unit: dict[int, list[GroupMeta]] = defaultdict(list)
  for m in metas:
    by_unit[m.storage_unit].append(m)
  arrays: dict[str, np.ndarray] = {}
  for unit, group_metas in by_unit.items():
    payloads = storage[unit].get([m.group_id for m in group_metas])
    for m, payload in zip(group_metas, payloads, strict=True):
      for name, x in payload.to_arrays().items():
        arrays[f"group/{m.group_id}/{name}"] = x
    hashes = list(dict.fromkeys(h for m in group_metas for h in m.image_hashes))
    hashes = [h for h in hashes if f"image/{h}" not in arrays]  # kept from another unit already
    for h, image in zip(hashes, storage[unit].get_images(hashes), strict=True):
      arrays[f"image/{h}"] = image
  buf = io.BytesIO()
  np.savez_compressed(buf, **arrays)
  return {
    "groups": [
      {
        "group_id": int(m.group_id),
        "storage_unit": int(m.storage_unit),
        "image_hashes": list(m.image_hashes),
      }
      for m in metas
    ],
    "npz": base64.b64encode(buf.getvalue()).decode("ascii"),
  }


def restore_groups(storage: Mapping[int, StorageUnit], snap: Mapping) -> int:
  """Puts a snapshot's groups back into their storage units; returns how many.

  Each payload goes back with its images in the group's image order (the one ``image_index``
  counts in), and is validated again by the unit's ``put``.

  Raises:
    ValueError: ``snap`` is not a dict written by :func:`snapshot_groups`.
    KeyError: a group's storage unit is not in ``storage``.
  """
  if not isinstance(snap, Mapping) or "groups" not in snap or "npz" not in snap:
    raise ValueError(
      "the payload snapshot lacks 'groups' and 'npz' (an older checkpoint format?); "
      "accepted: a dict written by knitjax.transfer.snapshot.snapshot_groups."
    )
  missing = sorted({g["storage_unit"] for g in snap["groups"]} - set(storage))
  if missing:
    raise KeyError(f"the payload snapshot names storage units {missing} that are not given.")
  with np.load(io.BytesIO(base64.b64decode(snap["npz"]))) as data:
    fields: dict[int, dict[str, np.ndarray]] = defaultdict(dict)
    images: dict[str, np.ndarray] = {}
    for key in data.files:
      kind, rest = key.split("/", 1)
      if kind == "image":
        images[rest] = data[key]
      else:
        gid, name = rest.split("/")
        fields[int(gid)][name] = data[key]
  for g in snap["groups"]:
    gid = int(g["group_id"])
    storage[g["storage_unit"]].put(
      gid,
      GroupPayload.from_arrays(fields[gid]),
      images=[images[h] for h in g["image_hashes"]],
    )
  return len(snap["groups"])
