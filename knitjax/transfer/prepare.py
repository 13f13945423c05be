"""Batch preparation: a released mini-batch -> this consumer's device-ready train batch.

:class:`MiniBatchPreparer` is the ``prepare`` of the on-demand feed (`knitjax.transfer.feed`):
it plans the consumers (`knitjax.transfer.consumer`), fetches exactly this consumer's groups from
their storage units and lays them out (`knitjax.transfer.access`), splits the rows into the
train step's micro-batches and places them on the train mesh. Text batches become global
``[K, rows / K, ...]`` arrays assembled from every consumer's part; multimodal batches
(`knitjax.train.mm_step`) also carry the mini-batch's unique images, padded to a static count.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax

from knitjax import faultpoints
from knitjax.train import mm_step, packing, prompt_sharing
from knitjax.train.batch import split_micro_batches
from knitjax.train.step import batch_shardings
from knitjax.transfer.access import BatchLayout, consumer_batch, to_global
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.consumer import ConsumerPlan, plan_consumers
from knitjax.transfer.storage import StorageUnit


class MiniBatchPreparer:
  """``prepare(minibatch) -> (device batch, info)`` for one consumer.

  Args:
    storage: every storage unit by id (a consumer reads only those holding its groups).
    layout: advantage estimator and the padded row layout.
    mesh: the train mesh.
    micro_batches: ``K``, micro-batches per mini-batch.
    consumer: this consumer's index (default: ``jax.process_index()``).
    num_consumers: consumers sharing a mini-batch (default: ``jax.process_count()``).
    locality_slack: how far token balance may give way to local fetches (consumer plan).
    pack: packs each mini-batch's rows (`knitjax.train.packing`); None: padded rows. With
      several consumers each packs its own rows into the same number of sequences, the most any
      consumer's rows need, which every consumer computes alike from the consumer plan and the
      groups' metadata (their prompt and response lengths); the packing metrics are then the
      whole mini-batch's, from that plan. A `knitjax.train.prompt_sharing.ShareSpec` lays the
      rows out with shared prompts (packed or not) the same way; a VLM's too.
    plan_for: ``plan_for(minibatch)``, the consumer plan announced for a mini-batch (a
      multi-process trainer's, `knitjax.distributed.trainer_processes`); None: every consumer plans
      alike (`knitjax.transfer.consumer.plan_consumers`).
    row_images: a VLM mini-batch carries one image per row (the naive encoder's layout,
      `knitjax.train.mm_step.prepare_batch`), not each unique image once.
  """

  def __init__(
    self,
    storage: Mapping[int, StorageUnit],
    *,
    layout: BatchLayout,
    mesh: jax.sharding.Mesh,
    micro_batches: int,
    consumer: int | None = None,
    num_consumers: int | None = None,
    locality_slack: float = 0.5,
    pack: packing.PackSpec | prompt_sharing.ShareSpec | None = None,
    plan_for: Callable[[MiniBatch], ConsumerPlan] | None = None,
    row_images: bool = False,
  ):
    self._storage, self._layout, self._mesh = storage, layout, mesh
    self._row_images = row_images
    self._k = micro_batches
    self._consumer = jax.process_index() if consumer is None else consumer
    self._consumers = jax.process_count() if num_consumers is None else num_consumers
    self._slack = locality_slack
    self._plan_for = plan_for or functools.partial(
      plan_consumers, num_consumers=self._consumers, locality_slack=locality_slack
    )
    if pack is not None and self._consumers > 1:
      if pack.multiple % self._consumers:
        raise ValueError(
          f"config.layout.packing='pack' is not accepted with {self._consumers} consumers and "
          f"{pack.multiple} micro-batch row shards (micro_batches x batch shards): each "
          "consumer needs an equal share; use packing 'off' or a batch axis that spans hosts."
        )
      pack = dataclasses.replace(pack, multiple=pack.multiple // self._consumers)
    self._pack = pack
    self._shared = isinstance(pack, prompt_sharing.ShareSpec)
    self._shardings = batch_shardings(mesh, packed=pack is not None, shared=self._shared)

  def __call__(self, minibatch: MiniBatch) -> tuple[dict[str, jax.Array], dict[str, float]]:
    plan = self._plan_for(minibatch)
    local, info = consumer_batch(
      minibatch,
      self._storage,
      layout=self._layout,
      consumer=self._consumer,
      num_consumers=self._consumers,
      locality_slack=self._slack,
      image_multiple=max(1, mm_step.batch_shards(self._mesh) // self._consumers),
      plan=plan,
    )
    faultpoints.point("fetch")
    if "images" in local:  # this consumer's unique images, padded to the same count everywhere
      if self._shared:
        local, share_info = self._pack.with_metrics(local)
        info = {**info, **share_info}
      host = mm_step.prepare_batch(local, self._k, row_images=self._row_images)
      return to_global(host, mm_step.batch_shardings(self._mesh, shared=self._shared)), info
    if self._pack is not None and self._consumers == 1:
      local, pack_info = self._pack.with_metrics(local)
      info = {**info, **pack_info}
    elif self._pack is not None:
      row_len = self._layout.prompt_len + self._layout.max_new_tokens
      parts = _consumer_groups(plan) if self._shared else _consumer_lengths(plan)
      count, pack_info = self._pack.plan_parts(parts, row_len=row_len)
      try:
        local = self._pack(local, count=count)
      except ValueError as e:
        raise ValueError(
          f"consumer {self._consumer}: {e} The count comes from the groups' metadata "
          "(GroupMeta.prompt_tokens, response_tokens), which disagrees with their payloads."
        ) from e
      info = {**info, **pack_info}  # the whole mini-batch's, from the plan
    return to_global(split_micro_batches(local, self._k), self._shardings), info


def _consumer_groups(plan: ConsumerPlan) -> list[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
  """Per consumer, each group's prompt and response token counts (its metadata), from which
  every consumer computes the same count of shared-prompt sequences."""
  return [[(g.prompt_tokens, g.response_tokens) for g in groups] for groups in plan.groups]


def _consumer_lengths(plan: ConsumerPlan) -> list[list[int]]:
  """Per consumer, the tokens of each of its rows, from the groups' metadata. Every consumer
  holds the same plan, so every one computes the same lists, and from them the same count of
  packed sequences (`knitjax.train.packing.plan_parts`)."""
  return [
    [p + r for g in groups for p, r in zip(g.prompt_tokens, g.response_tokens, strict=True)]
    for groups in plan.groups
  ]
