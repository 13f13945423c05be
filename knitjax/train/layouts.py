"""Training layouts: how one consumer's rows of a mini-batch become the train step's batch.

A mini-batch reaches a consumer as padded rows (`knitjax.train.batch.make_batch`: one sample
per row, ``P + N`` tokens). A :class:`Layout` owns everything from there to the device batch:

- :class:`Padded` keeps one row per sequence (the default);
- :class:`Packed` puts several rows into each sequence (`knitjax.train.packing`);
- :class:`Shared` runs each group's prompt once, its responses after it
  (`knitjax.train.prompt_sharing`), packed or in fixed spans;
- :class:`SharedPrefix` runs each group's prompt once per mini-batch, its responses in rows of
  their own that continue it, in any micro-batches (`knitjax.train.prefix`).

Each lays out a consumer's rows (:meth:`Layout.lay_out`, with its metrics), and, when several
consumers share a mini-batch, plans the sequence count every one of them lays out from the groups'
token counts alone (:meth:`Layout.plan_count`: each consumer computes the same count and the
whole mini-batch's metrics). :func:`micro_batches` splits the sequences into the step's
micro-batches (a VLM batch with its images: each unique image once, or one per row for the naive
encoder, ``row_images``), and :func:`shardings` names the step's fields and their shardings.
The train step itself reads ``packed``, ``shared`` and ``prefixed`` (which fields, attention and
scoring it compiles).

Adding a layout is one class here that implements :class:`Layout`, and one line in
`knitjax.runtime.layout_choice.build_layout` where the config chooses it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

import jax
import numpy as np

from knitjax.train import mm_step, packing, prefix, prompt_sharing
from knitjax.train.batch import split_micro_batches
from knitjax.train.step import batch_shardings

# A group's token counts, from its metadata: each row's prompt tokens and response tokens.
GroupTokens = tuple[Sequence[int], Sequence[int]]


class Layout(Protocol):
  """Released rows -> the train step's sequences.

  Attributes:
    packed: the sequences hold segments (packed or shared), which the step attends within.
    shared: the sequences share each group's prompt; the step scores at ``score_index``.
    prefixed: the rows continue the mini-batch's prompts, laid out once beside them.
    row_images: a VLM batch carries one image per row (the naive encoder), not each unique
      image once.
  """

  packed: bool
  shared: bool
  prefixed: bool
  row_images: bool

  def for_consumers(self, consumers: int) -> Layout:
    """This layout for one of ``consumers`` consumers sharing each mini-batch (each lays out an
    equal share of the sequences).

    Raises:
      ValueError: the sequences cannot be shared equally (one sentence).
    """
    ...

  def lay_out(
    self, rows: Mapping[str, np.ndarray], *, count: int = 0
  ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The sequences of ``rows`` and this layout's metrics of them; ``count``: lay out exactly
    this many sequences (0: as many as needed, rounded to the layout's multiple)."""
    ...

  def plan_count(
    self, parts: Sequence[Sequence[GroupTokens]], *, row_len: int
  ) -> tuple[int, dict[str, float]]:
    """The sequence count each consumer lays out (every part: one consumer's groups) and the
    whole mini-batch's metrics, from the groups' token counts alone."""
    ...


@dataclasses.dataclass(frozen=True)
class Padded:
  """One padded row per sequence: the rows as they arrive."""

  row_images: bool = False
  packed = False
  shared = False
  prefixed = False

  def for_consumers(self, consumers: int) -> Padded:
    del consumers
    return self

  def lay_out(self, rows, *, count=0):
    del count
    return dict(rows), {}

  def plan_count(self, parts, *, row_len):
    del parts, row_len
    return 0, {}


class _OfSpec:
  """A layout that is a spec of the layout's math (``spec.with_metrics``, ``spec.multiple``)."""

  def for_consumers(self, consumers: int):
    return dataclasses.replace(self, spec=_per_consumer(self.spec, consumers))

  def lay_out(self, rows, *, count=0):
    return self.spec.with_metrics(rows, count=count)


@dataclasses.dataclass(frozen=True)
class Packed(_OfSpec):
  """Several rows per sequence (`knitjax.train.packing.PackSpec`)."""

  spec: packing.PackSpec
  row_images: bool = False
  packed = True
  shared = False
  prefixed = False

  def plan_count(self, parts, *, row_len):
    lengths = [[p + r for g in groups for p, r in zip(*g, strict=True)] for groups in parts]
    return self.spec.plan_parts(lengths, row_len=row_len)


@dataclasses.dataclass(frozen=True)
class Shared(_OfSpec):
  """Each group's prompt once, its responses after it
  (`knitjax.train.prompt_sharing.ShareSpec`); a VLM batch's images pass through."""

  spec: prompt_sharing.ShareSpec
  row_images: bool = False
  packed = True
  shared = True
  prefixed = False

  def plan_count(self, parts, *, row_len):
    return self.spec.plan_parts(parts, row_len=row_len)


@dataclasses.dataclass(frozen=True)
class SharedPrefix:
  """Each group's prompt once per mini-batch, its rows continuing it in any micro-batches
  (`knitjax.train.prefix.PrefixSpec`): the padded rows' count, each row ``N`` wide."""

  spec: prefix.PrefixSpec
  row_images: bool = False
  packed = False
  shared = False
  prefixed = True

  def for_consumers(self, consumers: int) -> SharedPrefix:
    # Each consumer would lay out its own prompts; the rows' prompt indices would then have to
    # point into every consumer's, as a VLM's image indices do. Not built yet.
    if consumers != 1:
      raise ValueError(
        f"config.layout.prompt_sharing='prefix' is not accepted with {consumers} consumers (a "
        "trainer of several processes); use 'group' or 'off'."
      )
    return self

  def lay_out(self, rows, *, count=0):
    return self.spec.with_metrics(rows, count=count)

  def plan_count(self, parts, *, row_len):
    return self.spec.plan_parts(parts, row_len=row_len)


PADDED = Padded()  # the default layout


def _per_consumer(spec, consumers: int):
  """``spec`` with its sequence multiple divided among ``consumers``."""
  if consumers == 1:
    return spec
  if spec.multiple % consumers:
    raise ValueError(
      f"config.layout.packing='pack' is not accepted with {consumers} consumers and "
      f"{spec.multiple} micro-batch row shards (micro_batches x batch shards): each "
      "consumer needs an equal share; use packing 'off' or a batch axis that spans hosts."
    )
  return dataclasses.replace(spec, multiple=spec.multiple // consumers)


def micro_batches(
  layout: Layout,
  sequences: Mapping[str, np.ndarray],
  k: int,
  *,
  num_images: int = 0,
  shards: int = 1,
) -> dict[str, np.ndarray]:
  """Host ``[K, sequences / K, ...]`` arrays of the step; a VLM batch (``images``) also gets its
  images laid out (`knitjax.train.mm_step.prepare_batch`: padded to at least ``num_images``, a
  multiple of ``shards``, or one per row with ``layout.row_images``)."""
  if "images" in sequences:
    return mm_step.prepare_batch(
      dict(sequences), k, num_images=num_images, shards=shards, row_images=layout.row_images
    )
  if layout.prefixed:
    return prefix.split_micro_batches(sequences, k)
  return split_micro_batches(dict(sequences), k)


def shardings(
  layout: Layout, mesh: jax.sharding.Mesh, *, vlm: bool
) -> dict[str, jax.sharding.NamedSharding]:
  """The step's batch fields and their shardings on ``mesh`` (rows split over the batch axes;
  a VLM's images too)."""
  if vlm:
    return mm_step.batch_shardings(mesh, shared=layout.shared, prefixed=layout.prefixed)
  return batch_shardings(mesh, packed=layout.packed, shared=layout.shared, prefixed=layout.prefixed)
