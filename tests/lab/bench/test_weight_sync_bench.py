"""The weight-sync benchmark: publish variants, their bytes and the plain path's host detours."""

import jax
from flax import nnx

from configs.bench import weight_sync as bench_config
from knitjax import sharding
from knitjax.models.transformer import Transformer, TransformerConfig
from lab.bench.weight_sync import host_leaves, measure


def test_bf16_async_publishes_half_the_bytes_with_no_host_detour():
  c = bench_config.get_config("quick")
  devices = jax.devices()
  train_mesh = sharding.make_mesh((1, 4, 1), devices=devices[4:])
  rollout_mesh = sharding.make_mesh((-1, 1, 1), devices=devices[:4])
  model = TransformerConfig(**c.model)
  _, params = sharding.init_sharded(lambda: Transformer(model, rngs=nnx.Rngs(0)), train_mesh)
  rollout_shardings = sharding.state_shardings(params, rollout_mesh)
  # FSDP splits every matrix along d_model; the replicated rollout copy of those cannot be
  # assembled from whole train shards, so the plain device_put read them through the host.
  replicated = sum(x.sharding.is_fully_replicated for x in jax.tree.leaves(params))
  assert host_leaves(params, rollout_shardings) == len(jax.tree.leaves(params)) - replicated > 0
  plain = measure(params, rollout_shardings, "f32_plain", repeats=1)
  fast = measure(params, rollout_shardings, "bf16_async", repeats=1)
  assert plain["host_leaves"] > 0 and fast["host_leaves"] == 0
  assert (plain["route"], fast["route"]) == ("plain", "shard_wise")  # 4 train, 4 rollout devices
  assert fast["bytes"] * 2 == plain["bytes"] == 4 * plain["params"]
  assert fast["publish_s"] > 0 and plain["held_s"] == plain["publish_s"] > 0
