"""Centralized transfer: the single-controller baseline on-demand access is measured against.

What single-controller RL systems do with a train step's trajectories (``transfer.mode =
"centralized"``): one driver waits for the step's last mini-batch, gathers every payload of the
step from all storage units, materialises one sample per row (each row carries its own copy of
its image as a pixel array: ``G`` copies per group), builds the step's batch, splits it into the
mini-batches and each mini-batch into the consumers' rows (contiguous shares: a driver does not
know where a consumer lives), and sends each consumer its part. Training of a step starts when
its transfer is done; nothing is prefetched. The trainer sees each row's image as its own, so
its encoder runs once per row (`knitjax.train.mm_step` with ``image_index = arange(rows)``).

The math is on-demand access's: the same groups in the same mini-batches, the same advantages
and row layout (:func:`knitjax.transfer.access.fetch_minibatch`'s), so a step gives the same
update in both modes (tested); only where bytes go, how many and when differs.
:func:`transfer_bytes` counts them per endpoint for the benchmark.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from knitjax import faultpoints
from knitjax.train import layouts, mm_step
from knitjax.train.layouts import Layout
from knitjax.transfer.access import RowSpec, layout_groups
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.feed import POLL_S, Prepared
from knitjax.transfer.payload import GroupPayload
from knitjax.transfer.storage import StorageUnit


@dataclasses.dataclass(frozen=True)
class GatheredStep:
  """A train step gathered by the driver: per mini-batch, its batch and host metrics.

  Attributes:
    batches: per mini-batch, the trainer arrays of all its rows; image mini-batches carry
      ``images`` ``[rows, ...]`` (one copy per row; a row without image gets a blank one) and
      ``image_index`` (``arange(rows)``, -1 for a row without image).
    infos: per mini-batch, reward metrics and ``unique_images`` / ``image_bytes`` (what the
      trainer receives: every row's copy).
    fetched_bytes: bytes the driver received from each storage unit (unit id -> bytes).
  """

  batches: tuple[dict[str, np.ndarray], ...]
  infos: tuple[dict[str, float], ...]
  fetched_bytes: Mapping[int, int]


def gather_step(
  minibatches: Sequence[MiniBatch], storage: Mapping[int, StorageUnit], row_spec: RowSpec
) -> GatheredStep:
  """The driver's gather of one train step: one ``get`` per storage unit, rows materialised.

  Args:
    minibatches: the step's released mini-batches, in index order.
    storage: every storage unit by id.
    row_spec: advantage estimator and the padded rows' lengths and padding id (on-demand's).
  """
  by_unit: dict[int, list] = defaultdict(list)
  for mb in minibatches:
    for g in mb.groups:
      by_unit[g.storage_unit].append(g)
  payloads: dict[int, GroupPayload] = {}
  images: dict[str, np.ndarray] = {}
  fetched: dict[int, int] = {}
  for unit, groups in sorted(by_unit.items()):
    got = storage[unit].get([g.group_id for g in groups])
    payloads.update({g.group_id: p for g, p in zip(groups, got, strict=True)})
    # A single controller receives each group's images with the group (no sharing across
    # groups: it does not look at content hashes).
    hashes = [h for g in groups for h in g.image_hashes]
    pixels = storage[unit].get_images(hashes) if hashes else []
    fetched[unit] = sum(p.nbytes for p in got) + sum(x.nbytes for x in pixels)
    for h, x in zip(hashes, pixels, strict=True):
      images.setdefault(h, x)
  batches, infos = [], []
  for mb in minibatches:
    batch, info = _materialise(mb, payloads, images, row_spec)
    batches.append(batch)
    infos.append(info)
  return GatheredStep(tuple(batches), tuple(infos), fetched)


def _materialise(
  mb: MiniBatch,
  payloads: Mapping[int, GroupPayload],
  images: Mapping[str, np.ndarray],
  row_spec: RowSpec,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """One mini-batch laid out as the driver sends it: every row with its own image copy."""
  groups = [payloads[g.group_id] for g in mb.groups]
  batch, info = layout_groups(groups, row_spec, group_ids=[g.group_id for g in mb.groups])
  if any(g.image_hashes for g in mb.groups):
    like = images[next(h for g in mb.groups for h in g.image_hashes)]
    per_row, has = [], []
    for meta, p in zip(mb.groups, groups, strict=True):
      for k in range(p.num_samples):
        i = -1 if p.image_index is None or not meta.image_hashes else int(p.image_index[k])
        has.append(i >= 0)
        per_row.append(images[meta.image_hashes[i]] if i >= 0 else np.zeros_like(like))
    rows = len(per_row)
    batch["images"] = np.stack(per_row)  # G copies of each group's image: the baseline's cost
    batch["image_index"] = np.where(has, np.arange(rows), -1).astype(np.int32)
    info["unique_images"] = float(rows)
    info["image_bytes"] = float(batch["images"].nbytes)
  return batch, info


def split_rows(batch: Mapping[str, np.ndarray], num_consumers: int, consumer: int) -> dict:
  """Consumer ``consumer``'s contiguous share of a driver-built mini-batch (rows and images).

  ``image_index`` keeps pointing into the whole mini-batch's per-row images, which the
  consumers' shares concatenate back to in consumer order.
  """
  rows = len(batch["loss_mask"])
  if rows % num_consumers:
    raise ValueError(f"{rows} rows cannot be split over {num_consumers} consumers equally.")
  share = rows // num_consumers
  part = slice(consumer * share, (consumer + 1) * share)
  return {k: np.asarray(v)[part] for k, v in batch.items()}


def batch_bytes(batch: Mapping[str, np.ndarray]) -> int:
  """Bytes of a host batch (what a driver sends a consumer)."""
  return int(sum(np.asarray(v).nbytes for v in batch.values()))


class CentralizedPreparer:
  """``prepare_step(minibatches) -> [(device batch, info), ...]``: gather, materialise, place.

  The baseline's whole path for one train step on a one-process trainer (the driver and the
  consumer are the same process here; :func:`split_rows` is the split a many-consumer driver
  makes, which the benchmark times).

  Args:
    storage: every storage unit by id.
    row_spec: advantage estimator and the padded rows' lengths and padding id.
    mesh: the train mesh.
    micro_batches: ``K``, micro-batches per mini-batch.
    layout: how the rows become the step's sequences (`knitjax.train.layouts`; default: padded
      rows; a VLM's images one per row with ``row_images``, for the naive encoder, whose step
      then exchanges no image between devices).
  """

  def __init__(
    self,
    storage: Mapping[int, StorageUnit],
    *,
    row_spec: RowSpec,
    mesh: jax.sharding.Mesh,
    micro_batches: int,
    layout: Layout = layouts.PADDED,
  ):
    if jax.process_count() > 1:
      raise ValueError(
        "config.transfer.mode='centralized' is the one-process baseline; a multi-host trainer "
        "uses transfer.mode='on_demand'."
      )
    self._storage, self._row_spec, self._mesh, self._k = storage, row_spec, mesh, micro_batches
    self._layout = layout

  def __call__(self, minibatches: Sequence[MiniBatch]) -> list[tuple[dict, dict[str, float]]]:
    step = gather_step(minibatches, self._storage, self._row_spec)
    faultpoints.point("fetch")
    gathered = float(sum(step.fetched_bytes.values()))
    out = []
    for batch, info in zip(step.batches, step.infos, strict=True):
      vlm = "images" in batch
      n = len(batch["images"]) if vlm else 0
      batch, layout_info = self._layout.lay_out(batch)
      host = layouts.micro_batches(
        self._layout, batch, self._k, num_images=n, shards=mm_step.batch_shards(self._mesh)
      )
      placed = jax.device_put(host, layouts.shardings(self._layout, self._mesh, vlm=vlm))
      out.append((placed, {**info, **layout_info, "step_gathered_bytes": gathered}))
    return out


class CentralizedFeed:
  """Iterates :class:`~knitjax.transfer.feed.Prepared` mini-batches a whole train step at a time.

  Takes the step's ``minibatches`` released mini-batches (waiting for the last), prepares them
  all in the trainer's thread (no prefetch), then hands them out in order. ``taken_at`` of every
  mini-batch is when the step's last one was taken, so the first mini-batch's exposed fetch is
  the whole gather and the others' is 0.

  Args:
    take: ``take(timeout) -> MiniBatch | None`` (as for the on-demand feed; it may raise).
    prepare_step: e.g. a :class:`CentralizedPreparer`.
    count: mini-batches the trainer will consume (whole steps).
    minibatches: ``M``, mini-batches per train step.
  """

  def __init__(
    self,
    take: Callable[[float], MiniBatch | None],
    prepare_step: Callable[[Sequence[MiniBatch]], list[tuple[Any, dict[str, float]]]],
    *,
    count: int,
    minibatches: int,
  ):
    if count % minibatches:
      raise ValueError(f"a centralized feed hands out whole steps; {count} % {minibatches} != 0.")
    self._take, self._prepare, self._count, self._m = take, prepare_step, count, minibatches
    self._ready: collections.deque[Prepared] = collections.deque()
    self._taken = 0
    self._stop = threading.Event()

  def __iter__(self) -> CentralizedFeed:
    return self

  def __next__(self) -> Prepared:
    if not self._ready:
      self._gather()
    return self._ready.popleft()

  def _gather(self) -> None:
    if self._taken >= self._count:
      raise StopIteration
    step: list[MiniBatch] = []
    while len(step) < self._m:
      if self._stop.is_set():
        raise StopIteration
      mb = self._take(POLL_S)
      if mb is not None:
        step.append(mb)
    self._taken += len(step)
    taken = time.perf_counter()
    prepared = self._prepare(step)
    ready = time.perf_counter()
    for mb, (batch, info) in zip(step, prepared, strict=True):
      self._ready.append(Prepared(mb, batch, info, taken, ready, ready - taken))

  def close(self) -> None:
    self._stop.set()
