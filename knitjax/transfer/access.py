"""On-demand access: a consumer fetches a released mini-batch's payloads from storage.

The consumer asks each storage unit for exactly the groups of the mini-batch
that live there, computes the advantages of each (complete) group, and lays
the rows out as trainer arrays (:func:`knitjax.train.batch.make_batch`).

With several consumers (hosts), :func:`consumer_batch` fetches only the groups the consumer plan
(`knitjax.transfer.consumer`) gives this consumer; split into its slices of the micro-batches
(``[K, rows / (consumers K), ...]``), :func:`to_global` assembles the global arrays from every
process's part (``jax.make_array_from_process_local_data``); on one host that is a plain sharded
transfer.

Image prompts (groups with ``image_hashes``): each unique image of the mini-batch (by content
hash, across groups and storage units) is fetched once; the batch gains ``images`` ``[U, ...]`` and
``image_index`` ``[rows]`` (-1 for a row without image), the layout of
:mod:`knitjax.train.mm_step`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import jax
import numpy as np

from knitjax.train.advantages import compute_advantages
from knitjax.train.batch import make_batch
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.consumer import plan_consumers
from knitjax.transfer.storage import StorageUnit

FETCH_FIELDS = (
  "prompt_tokens",
  "prompt_lengths",
  "response_tokens",
  "response_lengths",
  "logprobs",
  "rewards",
)


def fetch_minibatch(
  minibatch: MiniBatch,
  storage: Mapping[int, StorageUnit],
  *,
  estimator: str,
  prompt_len: int,
  max_new_tokens: int,
  pad_id: int,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """Fetches and lays out one mini-batch; rows are grouped by group, in mini-batch order.

  Returns:
    The trainer arrays and a few host metrics (reward mean/std, response tokens).
  """
  by_unit: dict[int, list[int]] = defaultdict(list)
  for g in minibatch.groups:
    by_unit[g.storage_unit].append(g.group_id)
  fetched: dict[int, dict[str, np.ndarray]] = {}
  for unit, ids in by_unit.items():
    got = storage[unit].get(ids, FETCH_FIELDS)
    for k, gid in enumerate(ids):
      fetched[gid] = {f: got[f][k] for f in FETCH_FIELDS}

  prompts, responses, logps, advs, rewards = [], [], [], [], []
  for g in minibatch.groups:
    p = fetched[g.group_id]
    r = np.asarray(p["rewards"], np.float32)
    advs.append(np.asarray(compute_advantages(r[None], estimator))[0])
    rewards.append(r)
    for k in range(len(r)):
      n = int(p["response_lengths"][k])
      prompts.append(p["prompt_tokens"][k][: int(p["prompt_lengths"][k])])
      responses.append(p["response_tokens"][k][:n])
      logps.append(p["logprobs"][k][:n])
  batch = make_batch(
    prompts,
    responses,
    logps,
    np.concatenate(advs),
    prompt_len=prompt_len,
    max_new_tokens=max_new_tokens,
    pad_id=pad_id,
  )
  if any(g.image_hashes for g in minibatch.groups):
    batch["images"], batch["image_index"] = _fetch_images(minibatch, storage)
  all_rewards = np.concatenate(rewards)
  info = {
    "reward_mean": float(all_rewards.mean()),
    "reward_std": float(all_rewards.std()),
    "response_tokens": float(batch["loss_mask"].sum()),
    "signal_groups": float(np.mean([r.std() > 0 for r in rewards])),
  }
  if "images" in batch:
    info["unique_images"] = float(len(batch["images"]))
  return batch, info


def consumer_batch(
  minibatch: MiniBatch,
  storage: Mapping[int, StorageUnit],
  *,
  consumer: int,
  num_consumers: int,
  locality_slack: float = 0.5,
  **layout,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """This consumer's rows of the mini-batch (``[rows / num_consumers, ...]``, unsplit).

  Args:
    minibatch: a released mini-batch.
    storage: the storage units by id (a consumer reads only those holding its groups).
    consumer: this consumer's index (``jax.process_index()``).
    num_consumers: consumers sharing the mini-batch (``jax.process_count()``).
    locality_slack: see :func:`knitjax.transfer.consumer.plan_consumers`.
    **layout: ``estimator``, ``prompt_len``, ``max_new_tokens``, ``pad_id`` of
      :func:`fetch_minibatch`.
  """
  plan = plan_consumers(minibatch, num_consumers, locality_slack=locality_slack)
  batch, info = fetch_minibatch(plan.minibatch_for(consumer), storage, **layout)
  if "images" in batch and num_consumers > 1:
    raise ValueError("image mini-batches are laid out for one consumer (num_consumers=1) only.")
  info.update(plan.stats())
  return batch, info


def to_global(local: dict[str, np.ndarray], shardings: Mapping[str, jax.sharding.Sharding]):
  """Global device arrays from each process's local slices (axis 1, the rows, is sharded)."""
  if jax.process_count() == 1:
    return jax.device_put(dict(local), dict(shardings))
  n = jax.process_count()  # every process holds an equal share of the rows
  return {
    k: jax.make_array_from_process_local_data(
      shardings[k], v, (v.shape[0], v.shape[1] * n, *v.shape[2:])
    )
    for k, v in local.items()
  }


def _fetch_images(
  minibatch: MiniBatch, storage: Mapping[int, StorageUnit]
) -> tuple[np.ndarray, np.ndarray]:
  """The mini-batch's unique images (first-use order) and each row's index into them."""
  by_unit: dict[int, list[int]] = defaultdict(list)
  for g in minibatch.groups:
    if g.image_hashes:
      by_unit[g.storage_unit].append(g.group_id)
  image_index = {}
  for unit, ids in by_unit.items():
    got = storage[unit].get(ids, ["image_index"])["image_index"]
    image_index.update(zip(ids, got, strict=True))
  slots: dict[str, int] = {}
  unit_of: dict[str, int] = {}
  rows = []
  for g in minibatch.groups:
    if not g.image_hashes:
      rows += [-1] * g.num_samples
      continue
    for k in image_index[g.group_id]:
      h = g.image_hashes[int(k)]
      if h not in slots:
        slots[h], unit_of[h] = len(slots), g.storage_unit
      rows.append(slots[h])
  images: list = [None] * len(slots)
  for unit in set(unit_of.values()):
    hashes = [h for h in slots if unit_of[h] == unit]
    for h, image in zip(hashes, storage[unit].get_images(hashes), strict=True):
      images[slots[h]] = image
  return np.stack(images), np.asarray(rows, np.int32)
