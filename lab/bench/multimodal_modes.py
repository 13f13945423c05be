"""The two transfer modes of the multimodal benchmark, as the trainer process runs them.

`lab.bench.multimodal` describes the comparison. Here: the baseline's driver (a Ray actor),
the on-demand consumers (fetch threads, one per consumer, prefetch 1), one train step of each
mode with its per-mini-batch timings, and a storage-unit wrapper that counts bytes per caller.
Consumer ``c`` places its rows on device ``c`` of the train mesh, as each host of a multi-host
trainer places its shard; the trainer builds the global batch from those shards without a copy.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from knitjax.train import mm_step
from knitjax.train.step import host_metrics
from knitjax.transfer import centralized
from knitjax.transfer.access import RowSpec, consumer_batch
from knitjax.transfer.admission import MiniBatch

_STEP_COUNTS = ("encoder_images_encoded", "encoder_backward_passes", "num_seqs")


class Counted:
  """A storage unit that counts the bytes each ``get`` / ``get_images`` returns (per caller)."""

  def __init__(self, unit):
    self.unit, self.unit_id = unit, unit.unit_id
    self.lock, self.bytes, self.image_bytes = threading.Lock(), {}, {}

  def _add(self, table, n):
    who = threading.current_thread().name
    with self.lock:
      table[who] = table.get(who, 0) + n

  def get(self, ids):
    out = self.unit.get(ids)
    self._add(self.bytes, sum(p.nbytes for p in out))
    return out

  def get_images(self, hashes):
    out = self.unit.get_images(hashes)
    self._add(self.image_bytes, sum(x.nbytes for x in out))
    return out


class Driver:
  """The centralized baseline's single controller (a Ray actor: its own process)."""

  def __init__(self, storage, row_spec: RowSpec, consumers: int, row_format: str):
    self._storage, self._row_spec, self._consumers = storage, row_spec, consumers
    self._dtype = np.float32 if row_format == "float32" else np.uint8
    self._parts: dict[int, list] = {}

  def gather(self, minibatches: Sequence[MiniBatch]) -> dict:
    """Gathers and splits one train step; returns the bytes it received and will send."""
    t = time.perf_counter()
    step = centralized.gather_step(minibatches, self._storage, self._row_spec)
    parts: dict[int, list] = {c: [] for c in range(self._consumers)}
    for batch in step.batches:
      if "images" in batch:  # the processor's pixel array per row (float32: 4 bytes a value)
        batch = {**batch, "images": batch["images"].astype(self._dtype)}
      for c in range(self._consumers):
        parts[c].append(centralized.split_rows(batch, self._consumers, c))
    self._parts = parts
    sent = {c: sum(centralized.batch_bytes(p) for p in ps) for c, ps in parts.items()}
    sent_images = {
      c: sum(p["images"].nbytes for p in ps if "images" in p) for c, ps in parts.items()
    }
    return {
      "received": dict(step.fetched_bytes),
      "sent": sent,
      "sent_images": sent_images,
      "gather_s": time.perf_counter() - t,
    }

  def take(self, consumer: int) -> list:
    return self._parts.pop(consumer)


def place(part: Mapping[str, np.ndarray], k: int, device, *, row_images: bool = False) -> dict:
  """A consumer's rows split into micro-batches and put on its own device (as each host of a
  multi-host trainer places its shard); ``row_images``: the naive step's layout."""
  return jax.device_put(mm_step.prepare_batch(dict(part), k, row_images=row_images), device)


def global_batch(placed: Sequence[Mapping[str, jax.Array]], shardings) -> dict:
  """The global batch from every consumer's placed rows, without copying (micro-batch k of the
  global batch: each consumer's k-th slice in consumer order; images: each consumer's slots).
  ``placed`` are this process's consumers; every process of a multi-process trainer has as many."""
  out = {}
  for f, sh in shardings.items():
    parts = [p[f] for p in placed]
    axis = 0 if f == "images" else 1
    shape = list(parts[0].shape)
    shape[axis] *= len(parts) * jax.process_count()
    out[f] = jax.make_array_from_single_device_arrays(tuple(shape), sh, parts)
  return out


class OnDemandConsumers:
  """One fetch thread per consumer over all of a run's on-demand mini-batches, prefetch 1.

  Consumer ``c`` fetches its groups of each mini-batch once the mini-batch is released
  (``release``), each unique image once, places its rows on device ``c`` and hands them over
  through a one-slot queue (like the runtime's Grain thread prefetch: one ready, one being
  prepared). The trainer thread takes every consumer's part, waits until its copy is on the
  device, and computes. ``transfer_s`` of a mini-batch: its fetch and layout and the placement
  call (the copy itself may finish later, after a running step; any wait for it is exposed).
  In a multi-process trainer, ``first`` is this process's first consumer index of
  ``num_consumers`` in all (default: this process's devices are every consumer).
  """

  def __init__(
    self,
    minibatches,
    storage,
    row_spec: RowSpec,
    micro_batches: int,
    devices,
    *,
    first: int = 0,
    num_consumers: int | None = None,
  ):
    self._mbs = list(minibatches)
    self._released = {(mb.step, mb.index): threading.Event() for mb in self._mbs}
    self.queues = [queue.Queue(maxsize=1) for _ in devices]
    total = num_consumers or len(devices)
    self._threads = [
      threading.Thread(
        target=self._fetch,
        args=(k, first + k, d, storage, row_spec, micro_batches, total),
        name=f"consumer-{first + k}",
        daemon=True,
      )
      for k, d in enumerate(devices)
    ]
    for t in self._threads:
      t.start()

  def release(self, minibatches) -> None:
    for mb in minibatches:
      self._released[(mb.step, mb.index)].set()

  def _fetch(self, k, c, device, storage, row_spec, micro_batches, consumers):
    for mb in self._mbs:
      self._released[(mb.step, mb.index)].wait()
      t = time.perf_counter()
      part, info = consumer_batch(
        mb, storage, row_spec=row_spec, consumer=c, num_consumers=consumers, locality_slack=0.0
      )
      # Not waited for here, as the runtime does not: on the CPU a copy onto a device that runs
      # the (multi-device) train step completes only after it, so waiting would hold back the
      # next mini-batch's host work until the step ends. The trainer waits for the copy before it
      # computes (counted as exposed).
      placed = place(part, micro_batches, device)
      self.queues[k].put((placed, info, t, time.perf_counter()))

  def join(self) -> None:
    for t in self._threads:
      t.join()


def on_demand_step(state, step_fn, minibatches, consumers, shardings, *, next_step, pipelined):
  """One train step with on-demand access: the consumers fetch ahead, the trainer computes.

  The step's mini-batches are released when it starts, unless ``pipelined`` released them
  already (during the previous step's last mini-batch; it then releases ``next_step``'s).
  """
  t_release = time.perf_counter()
  if not pipelined:
    consumers.release(minibatches)
  rows = []
  for j, mb in enumerate(minibatches):
    if pipelined and j == len(minibatches) - 1 and next_step:
      consumers.release(next_step)  # the next step's mini-batches are complete: fetch ahead
    t_want = time.perf_counter()
    got = [q.get() for q in consumers.queues]
    batch = jax.block_until_ready(global_batch([p for p, *_ in got], shardings))
    t_got = time.perf_counter()
    state, metrics = step_fn(state, batch)
    m = host_metrics(metrics)
    t_done = time.perf_counter()
    rows.append(
      {
        "transfer_s": max(end - start for *_, start, end in got),
        "exposed_s": t_got - t_want,
        "compute_s": t_done - t_got,
        "release_to_compute_s": t_got - t_release,
        "groups": [g.group_id for g in mb.groups],
        "unique_images": sum(info["unique_images"] for _, info, *_ in got),
        **{k: m[k] for k in _STEP_COUNTS},
      }
    )
  return state, rows


def centralized_step(state, step_fn, minibatches, driver, micro_batches, devices, shardings):
  """One train step through the driver: gather, split, send, place; then train the mini-batches.
  Nothing is prefetched: the step's transfer starts when the trainer starts the step."""
  import ray

  t_release = time.perf_counter()
  sizes = ray.get(driver.gather.remote(minibatches))
  placed: list = [None] * len(devices)

  def take(c):
    parts = ray.get(driver.take.remote(c))
    placed[c] = [place(p, micro_batches, devices[c], row_images=True) for p in parts]
    jax.block_until_ready(placed[c])

  threads = [
    threading.Thread(target=take, args=(c,), name=f"consumer-{c}") for c in range(len(devices))
  ]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  t_have = time.perf_counter()
  rows = []
  for j, mb in enumerate(minibatches):
    t_want = time.perf_counter()
    batch = global_batch([placed[c][j] for c in range(len(devices))], shardings)
    t_got = time.perf_counter()
    state, metrics = step_fn(state, batch)
    m = host_metrics(metrics)
    t_done = time.perf_counter()
    rows.append(
      {
        "transfer_s": (t_have - t_release) + (t_got - t_want),
        "exposed_s": (t_have - t_release if j == 0 else 0.0) + (t_got - t_want),
        "compute_s": t_done - t_got,
        "release_to_compute_s": t_got - t_release,
        "groups": [g.group_id for g in mb.groups],
        "unique_images": float(sum(len(placed[c][j]["images"]) for c in range(len(devices)))),
        **{k: m[k] for k in _STEP_COUNTS},
      }
    )
  return state, rows, sizes
