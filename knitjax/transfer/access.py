"""On-demand access: a consumer fetches a released mini-batch's payloads from storage.

The consumer asks each storage unit for exactly the groups of the mini-batch that live there
(their ``GroupPayload``s), computes the advantages of each (complete) group, stacks the groups'
rows (:func:`knitjax.transfer.payload.stack_rows`) and lays them out as trainer arrays
(:func:`knitjax.train.batch.make_batch`, which honours ``response_mask``). ``RowSpec`` says
how (advantage estimator, row lengths, padding id).

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

import dataclasses
from collections import defaultdict
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from knitjax.train.advantages import ESTIMATORS, compute_advantages
from knitjax.train.batch import make_batch
from knitjax.train.step_advantages import ADVANTAGES
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.consumer import ConsumerPlan, plan_consumers
from knitjax.transfer.payload import GroupPayload, stack_rows
from knitjax.transfer.storage import StorageUnit


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowSpec:
  """How a consumer turns fetched groups into trainer arrays.

  Attributes:
    estimator: advantage estimator, a key of ``knitjax.train.advantages.ESTIMATORS``, or
      ``gae`` (the step computes per-token advantages with its critic; the host none).
    prompt_len: ``P``, the padded prompt length of a trainer row.
    max_new_tokens: ``N``, the padded response length of a trainer row.
    pad_id: padding token id.
  """

  estimator: str
  prompt_len: int
  max_new_tokens: int
  pad_id: int

  def __post_init__(self):
    if self.estimator not in ADVANTAGES:
      raise ValueError(
        f"RowSpec.estimator is {self.estimator!r}; accepted: one of {list(ADVANTAGES)}."
      )
    for name, low in (("prompt_len", 1), ("max_new_tokens", 1), ("pad_id", 0)):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"RowSpec.{name} is {value!r}; accepted: an int >= {low}.")


def fetch_minibatch(
  minibatch: MiniBatch, storage: Mapping[int, StorageUnit], row_spec: RowSpec
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """Fetches and lays out one mini-batch; rows are grouped by group, in mini-batch order.

  Args:
    minibatch: the groups to fetch (one ``get`` per storage unit holding some of them).
    storage: the storage units by id.
    row_spec: advantage estimator and the padded rows' lengths and padding id.

  Returns:
    The trainer arrays and a few host metrics (reward mean/std, loss-carrying response tokens,
    fraction of groups with a reward signal).
  """
  by_unit: dict[int, list[int]] = defaultdict(list)
  for g in minibatch.groups:
    by_unit[g.storage_unit].append(g.group_id)
  fetched: dict[int, GroupPayload] = {}
  for unit, ids in by_unit.items():
    fetched.update(zip(ids, storage[unit].get(ids), strict=True))
  batch, info = layout_groups(
    [fetched[g.group_id] for g in minibatch.groups],
    row_spec,
    group_ids=[g.group_id for g in minibatch.groups],
  )
  if any(g.image_hashes for g in minibatch.groups):
    batch["images"], batch["image_index"] = _fetch_images(minibatch, fetched, storage)
  info["fetched_bytes"] = float(sum(p.nbytes for p in fetched.values()))
  if "images" in batch:
    info["unique_images"] = float(len(batch["images"]))
    info["image_bytes"] = float(batch["images"].nbytes)
  return batch, info


def layout_groups(
  payloads: Sequence[GroupPayload], row_spec: RowSpec, *, group_ids: Sequence[int] | None = None
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """The groups' rows as trainer arrays (advantages per group) and their reward metrics.

  Every row also carries its sequence reward and its group's id (``group_ids``, e.g. the
  ``GroupMeta.group_id``s, unique across consumers; None: the groups' positions here), from
  which the step recomputes advantages when it needs the model for them (GAE, KL as a reward).
  """
  # Advantages are per group (its G samples), so they are computed before the rows are stacked.
  # GAE's are per token, from the critic: the step computes them, the host leaves zeros.
  advantages = [
    np.zeros(p.num_samples, np.float32)
    if row_spec.estimator not in ESTIMATORS
    else np.asarray(compute_advantages(p.rewards[None], row_spec.estimator), np.float32)[0]
    for p in payloads
  ]
  rows = stack_rows(payloads)
  if group_ids is None:
    group_ids = range(len(payloads))
  rewards = np.concatenate([p.rewards for p in payloads])
  batch = make_batch(
    rows,
    np.concatenate(advantages),
    prompt_len=row_spec.prompt_len,
    max_new_tokens=row_spec.max_new_tokens,
    pad_id=row_spec.pad_id,
    rewards=rewards,
    group_ids=np.repeat(np.asarray(list(group_ids), np.int64), [p.num_samples for p in payloads]),
  )
  info = {
    "reward_mean": float(rewards.mean()),
    "reward_std": float(rewards.std()),
    "response_tokens": float(batch["loss_mask"].sum()),  # masked-off tokens are not counted
    "signal_groups": float(np.mean([p.rewards.std() > 0 for p in payloads])),
    "solved_fraction": float(np.mean(rewards >= 1.0)),  # samples with the full reward
    "env_token_rows": env_token_rows(rows),
  }
  return batch, info


def env_token_rows(rows: Mapping[str, np.ndarray]) -> float:
  """Fraction of samples whose response holds tokens off the response mask (environment turns
  of a multi-turn trajectory, e.g. tool results: the fraction that called a tool)."""
  width = rows["response_mask"].shape[1]
  inside = np.arange(width)[None, :] < rows["response_lengths"][:, None]
  return float(np.mean((inside & ~rows["response_mask"]).any(axis=1)))


def consumer_batch(
  minibatch: MiniBatch,
  storage: Mapping[int, StorageUnit],
  *,
  row_spec: RowSpec,
  consumer: int,
  num_consumers: int,
  locality_slack: float = 0.5,
  image_multiple: int = 1,
  plan: ConsumerPlan | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """This consumer's rows of the mini-batch (``[rows / num_consumers, ...]``, unsplit).

  Image mini-batches: the consumer fetches each unique image of its own groups once and pads
  them with blank images to ``S`` (:func:`image_slots`, the same for every consumer, so the
  global images array is every consumer's ``S`` images in consumer order); ``image_index`` points
  into that global array (offset ``consumer * S``; -1: no image).

  Args:
    minibatch: a released mini-batch.
    storage: the storage units by id (a consumer reads only those holding its groups).
    row_spec: advantage estimator and the padded rows' lengths and padding id.
    consumer: this consumer's index (``jax.process_index()``).
    num_consumers: consumers sharing the mini-batch (``jax.process_count()``).
    locality_slack: see :func:`knitjax.transfer.consumer.plan_consumers`.
    image_multiple: ``S`` is rounded up to a multiple of this (a consumer's image shards).
    plan: the mini-batch's consumer plan as announced to every consumer (None: planned here,
      deterministically, as every consumer would).
  """
  if plan is None:
    plan = plan_consumers(minibatch, num_consumers, locality_slack=locality_slack)
  elif (plan.step, plan.index, plan.num_consumers) != (
    minibatch.step,
    minibatch.index,
    num_consumers,
  ):
    raise ValueError(
      f"the consumer plan of mini-batch {(plan.step, plan.index)} for {plan.num_consumers} "
      f"consumers does not fit mini-batch {(minibatch.step, minibatch.index)} and "
      f"{num_consumers} consumers."
    )
  batch, info = fetch_minibatch(plan.minibatch_for(consumer), storage, row_spec)
  if any(g.image_hashes for g in minibatch.groups):
    slots = image_slots(plan, multiple=image_multiple)
    if "images" not in batch:  # none of this consumer's groups has an image: blanks only
      g = next(g for g in minibatch.groups if g.image_hashes)
      (like,) = storage[g.storage_unit].get_images(g.image_hashes[:1])
      rows = len(batch["loss_mask"])
      batch = {**batch, "images": np.zeros((0, *like.shape), like.dtype)}
      batch["image_index"] = np.full(rows, -1, np.int32)
    batch = _consumer_images(batch, slots, offset=consumer * slots)
    info["image_slots"] = float(slots)
  if num_consumers > 1:
    # The rewards of the consumer's rows describe its share; every consumer holds the whole
    # mini-batch's GroupMeta, so the reward metrics it reports are the mini-batch's.
    # (``response_tokens`` stays this consumer's count of loss-carrying tokens.)
    info.update(minibatch_reward_info(minibatch.groups))
  info.update(plan.stats())
  return batch, info


def image_slots(plan: ConsumerPlan, *, multiple: int = 1) -> int:
  """``S``: images each consumer lays out for a mini-batch, padded (a static shape per step).

  The most images any consumer's groups name (``GroupMeta.image_hashes``, an upper bound of the
  unique images it fetches), at least 1, rounded up to ``multiple``.
  """
  most = max(sum(len(g.image_hashes) for g in groups) for groups in plan.groups)
  return -(-max(most, 1) // multiple) * multiple


def _consumer_images(batch: dict[str, np.ndarray], slots: int, *, offset: int) -> dict:
  """Pads the consumer's images to ``slots`` blanks and moves its indices to the global array."""
  images = batch["images"]
  u = len(images)
  if u > slots:
    raise ValueError(f"a consumer fetched {u} unique images but lays out only {slots}.")
  if u < slots:
    images = np.concatenate([images, np.zeros((slots - u, *images.shape[1:]), images.dtype)])
  index = batch["image_index"]
  return {**batch, "images": images, "image_index": np.where(index >= 0, index + offset, -1)}


def minibatch_reward_info(groups) -> dict[str, float]:
  """reward_mean, reward_std (over all samples) and signal_groups of a mini-batch's groups,
  exactly, from each group's sample count, reward mean and reward standard deviation."""
  n = np.array([g.num_samples for g in groups], np.float64)
  mean = np.array([g.reward_mean for g in groups], np.float64)
  std = np.array([g.reward_std for g in groups], np.float64)
  total_mean = float((n * mean).sum() / n.sum())
  second_moment = float((n * (std**2 + mean**2)).sum() / n.sum())
  return {
    "reward_mean": total_mean,
    "reward_std": float(np.sqrt(max(second_moment - total_mean**2, 0.0))),
    "signal_groups": float(np.mean(std > 0)),
  }


def to_global(local: dict[str, np.ndarray], shardings: Mapping[str, jax.sharding.Sharding]):
  """Global device arrays from each process's local slices (axis 1, the rows, is sharded;
  ``images``: axis 0, each process's image slots)."""
  if jax.process_count() == 1:
    return jax.device_put(dict(local), dict(shardings))
  n = jax.process_count()  # every process holds an equal share of the rows (and image slots)

  def global_shape(k, v):
    if k == "images":  # [S, H, W, C] per process: its slots, in process order
      return (v.shape[0] * n, *v.shape[1:])
    return (v.shape[0], v.shape[1] * n, *v.shape[2:])

  return {
    k: jax.make_array_from_process_local_data(shardings[k], v, global_shape(k, v))
    for k, v in local.items()
  }


def _fetch_images(
  minibatch: MiniBatch, payloads: Mapping[int, GroupPayload], storage: Mapping[int, StorageUnit]
) -> tuple[np.ndarray, np.ndarray]:
  """The mini-batch's unique images (first-use order) and each row's index into them."""
  slots: dict[str, int] = {}
  unit_of: dict[str, int] = {}
  rows = []
  for g in minibatch.groups:
    index = payloads[g.group_id].image_index
    if not g.image_hashes or index is None:
      rows.append(np.full(g.num_samples, -1, np.int32))
      continue
    # GroupMeta.image_hashes is in the group's image order, the one image_index counts in; slots
    # go to the images the rows use, in first-use order.
    used, first = np.unique(index, return_index=True)
    slot_of = np.full(len(g.image_hashes), -1, np.int32)
    for k in used[np.argsort(first)]:
      h = g.image_hashes[int(k)]
      if h not in slots:
        slots[h], unit_of[h] = len(slots), g.storage_unit
      slot_of[k] = slots[h]
    rows.append(slot_of[index])
  images: list = [None] * len(slots)
  for unit in set(unit_of.values()):
    hashes = [h for h in slots if unit_of[h] == unit]
    for h, image in zip(hashes, storage[unit].get_images(hashes), strict=True):
      images[slots[h]] = image
  return np.stack(images), np.concatenate(rows)
