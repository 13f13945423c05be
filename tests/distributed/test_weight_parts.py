"""Weights as each process's first-hand shards, reassembled by a rollout actor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from knitjax import records
from knitjax.distributed.weight_parts import (
  WireFormat,
  assemble,
  own_parts,
  parts_bytes,
  wire_format_of,
)
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.consumer import ConsumerPlan, plan_consumers
from knitjax.transfer.group import GroupMeta


def _params():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))  # noqa: E731
  return {
    "layer": {
      "kernel": put(jnp.arange(32.0).reshape(8, 4), "a", "b"),  # split both ways
      "bias": put(jnp.arange(4.0), None),  # replicated on all 4 devices
    },
    "embed": put(jnp.arange(24, dtype=jnp.bfloat16).reshape(6, 4), "b"),  # replicated over "a"
  }


def test_parts_cover_every_value_once_and_reassemble_exactly():
  pure = _params()
  wire_format, leaves = wire_format_of(pure)
  parts = own_parts(leaves)
  # Replicas are sent once: the bytes are one copy of every leaf.
  assert parts_bytes(parts) == wire_format.nbytes == sum(x.nbytes for x in leaves)
  # Split as if by two processes (any split of the parts reassembles the same).
  got = assemble(wire_format, [parts[::2], parts[1::2]])
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(jax.device_get(pure)), strict=True):
    assert a.dtype == b.dtype and np.array_equal(a, b)
  assert set(got) == {"layer", "embed"} and set(got["layer"]) == {"kernel", "bias"}


def test_a_missing_or_repeated_part_is_one_sentence_naming_the_leaf():
  wire_format, leaves = wire_format_of(_params())
  parts = own_parts(leaves)
  kernel = [p for p in parts if wire_format.paths[p[0]] == ("layer", "kernel")]
  with pytest.raises(ValueError, match=r"sent 24 of the 32 values of leaf layer/kernel"):
    assemble(wire_format, [[p for p in parts if p is not kernel[0]]])
  with pytest.raises(ValueError, match=r"of leaf layer/kernel: a process's shards are missing"):
    assemble(wire_format, [parts, kernel[:1]])
  assert isinstance(wire_format, WireFormat)


def test_an_announced_plan_round_trips_through_json():
  groups = tuple(
    GroupMeta(
      group_id=i,
      cls="arith" if i % 2 else "think",
      storage_unit=i % 3,
      gen_version=1,
      num_samples=2,
      prompt_tokens=(3, 3),
      response_tokens=(i + 1, 2),
      reward_mean=0.5,
      reward_std=0.5,
    )
    for i in range(4)
  )
  mb = MiniBatch(2, 1, groups)
  plan = plan_consumers(mb, 2)
  assert records.from_json(ConsumerPlan, records.to_json(plan)) == plan
  assert records.from_json(MiniBatch, records.to_json(mb)) == mb
