"""Batch preparation: a released mini-batch -> this consumer's device-ready train batch.

:class:`MiniBatchPreparer` is the ``prepare`` of the on-demand feed (`knitjax.transfer.feed`):
it plans the consumers (`knitjax.transfer.consumer`), fetches exactly this consumer's groups from
their storage units and lays them out (`knitjax.transfer.access`), splits the rows into the
train step's micro-batches and places them on the train mesh. Text batches become global
``[K, rows / K, ...]`` arrays assembled from every consumer's part; multimodal batches
(`knitjax.train.mm_step`) also carry the mini-batch's unique images, padded to a static count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import jax

from knitjax import faultpoints
from knitjax.train import layouts, mm_step
from knitjax.train.layouts import Layout
from knitjax.transfer.access import RowSpec, consumer_batch, to_global
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.consumer import ConsumerPlan, plan_consumers
from knitjax.transfer.storage import StorageUnit


class MiniBatchPreparer:
  """``prepare(minibatch) -> (device batch, info)`` for one consumer.

  Args:
    storage: every storage unit by id (a consumer reads only those holding its groups).
    row_spec: advantage estimator and the padded rows' lengths and padding id.
    mesh: the train mesh.
    micro_batches: ``K``, micro-batches per mini-batch.
    consumer: this consumer's index (default: ``jax.process_index()``).
    num_consumers: consumers sharing a mini-batch (default: ``jax.process_count()``).
    locality_slack: how far token balance may give way to local fetches (consumer plan).
    layout: how the rows become the step's sequences (`knitjax.train.layouts`; default: padded
      rows). With several consumers each lays out its own rows into the same number of
      sequences, the most any consumer's rows need, which every consumer computes alike from the
      consumer plan and the groups' metadata (their prompt and response token counts); the
      layout's metrics are then the whole mini-batch's, from that plan.
    plan_for: ``plan_for(minibatch)``, the consumer plan announced for a mini-batch (a
      multi-process trainer's, `knitjax.distributed.trainer_processes`); None: every consumer plans
      alike (`knitjax.transfer.consumer.plan_consumers`).
  """

  def __init__(
    self,
    storage: Mapping[int, StorageUnit],
    *,
    row_spec: RowSpec,
    mesh: jax.sharding.Mesh,
    micro_batches: int,
    consumer: int | None = None,
    num_consumers: int | None = None,
    locality_slack: float = 0.5,
    layout: Layout = layouts.PADDED,
    plan_for: Callable[[MiniBatch], ConsumerPlan] | None = None,
  ):
    self._storage, self._row_spec, self._mesh = storage, row_spec, mesh
    self._k = micro_batches
    self._consumer = jax.process_index() if consumer is None else consumer
    self._consumers = jax.process_count() if num_consumers is None else num_consumers
    self._slack = locality_slack
    self._plan_for = plan_for or functools.partial(
      plan_consumers, num_consumers=self._consumers, locality_slack=locality_slack
    )
    self._layout = layout.for_consumers(self._consumers)

  def __call__(self, minibatch: MiniBatch) -> tuple[dict[str, jax.Array], dict[str, float]]:
    plan = self._plan_for(minibatch)
    local, info = consumer_batch(
      minibatch,
      self._storage,
      row_spec=self._row_spec,
      consumer=self._consumer,
      num_consumers=self._consumers,
      locality_slack=self._slack,
      image_multiple=max(1, mm_step.batch_shards(self._mesh) // self._consumers),
      plan=plan,
    )
    faultpoints.point("fetch")
    vlm = "images" in local  # this consumer's unique images, padded to the same count everywhere
    if self._consumers == 1 or vlm:
      local, layout_info = self._layout.lay_out(local)
    else:
      parts = [[(g.prompt_tokens, g.response_tokens) for g in groups] for groups in plan.groups]
      row_len = self._row_spec.prompt_len + self._row_spec.max_new_tokens
      count, layout_info = self._layout.plan_count(parts, row_len=row_len)
      try:
        local, _ = self._layout.lay_out(local, count=count)
      except ValueError as e:
        raise ValueError(
          f"consumer {self._consumer}: {e} The count comes from the groups' metadata "
          "(GroupMeta.prompt_tokens, response_tokens), which disagrees with their payloads."
        ) from e
    host = layouts.micro_batches(self._layout, local, self._k)
    return to_global(host, layouts.shardings(self._layout, self._mesh, vlm=vlm)), {
      **info,
      **layout_info,
    }
