"""Weights that leave a train mesh spanning processes as each process's own shards.

A trainer process sends only the shards it holds first-hand (``replica_id == 0`` among its
addressable shards), so no process ever gathers the whole parameter set: together the processes
send every element of every leaf exactly once. A rollout actor reassembles the leaves from all
processes' parts (:func:`assemble`), checking that the parts cover each leaf exactly.

:class:`ShardedWeights` is what a multi-process trainer publishes to Ray rollout actors: the
wire format (leaf paths, shapes, wire dtypes) and one object-store reference per trainer process.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

# (leaf number, ((start, stop) per dimension), the shard's values)
Part = tuple[int, tuple[tuple[int, int], ...], np.ndarray]


@dataclasses.dataclass(frozen=True)
class WireFormat:
  """The leaves of a pure params dict: their key paths, shapes and (wire) dtypes."""

  paths: tuple[tuple[Any, ...], ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]

  @property
  def nbytes(self) -> int:
    return sum(
      int(np.prod(s)) * np.dtype(_dtype(d)).itemsize
      for s, d in zip(self.shapes, self.dtypes, strict=True)
    )


@dataclasses.dataclass(frozen=True)
class ShardedWeights:
  """One version as every trainer process's parts in Ray's object store (``refs[k]``: process
  ``k``'s list of :data:`Part`)."""

  wire_format: WireFormat
  refs: tuple[Any, ...]


def _dtype(name: str):
  import ml_dtypes  # bfloat16 and friends, as JAX names them

  return np.dtype(getattr(ml_dtypes, name, None) or name)


def wire_format_of(pure: dict) -> tuple[WireFormat, list]:
  """The wire format of a (nested) pure params dict and its leaves, in that order."""
  import jax

  flat, _ = jax.tree_util.tree_flatten_with_path(pure)
  paths = tuple(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path) for path, _ in flat)
  leaves = [x for _, x in flat]
  wire_format = WireFormat(
    paths=paths,
    shapes=tuple(tuple(int(d) for d in x.shape) for x in leaves),
    dtypes=tuple(str(x.dtype) for x in leaves),
  )
  return wire_format, leaves


def own_parts(leaves) -> list[Part]:
  """This process's first-hand shards of ``leaves`` (jax.Arrays), copied to host memory."""
  parts = []
  for i, x in enumerate(leaves):
    for shard in x.addressable_shards:
      if shard.replica_id != 0:
        continue
      index = tuple(
        (s.start or 0, d if s.stop is None else s.stop)
        for s, d in zip(shard.index, x.shape, strict=True)
      )
      parts.append((i, index, np.asarray(shard.data)))
  return parts


def parts_bytes(parts: list[Part]) -> int:
  return sum(a.nbytes for _, _, a in parts)


def assemble(wire_format: WireFormat, parts_per_process: list[list[Part]]) -> dict:
  """The pure params dict from every process's parts.

  Raises:
    ValueError: the parts do not cover some leaf exactly once (one sentence naming it).
  """
  out = [
    np.empty(s, _dtype(d)) for s, d in zip(wire_format.shapes, wire_format.dtypes, strict=True)
  ]
  filled = [0] * len(out)
  for parts in parts_per_process:
    for i, index, values in parts:
      out[i][tuple(slice(a, b) for a, b in index)] = values
      filled[i] += values.size
  for i, (x, n) in enumerate(zip(out, filled, strict=True)):
    if n != x.size:
      raise ValueError(
        f"the trainer processes sent {n} of the {x.size} values of leaf "
        f"{'/'.join(map(str, wire_format.paths[i]))}: a process's shards are missing or repeated."
      )
  pure: dict = {}
  for path, x in zip(wire_format.paths, out, strict=True):
    node = pure
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = x
  return pure
