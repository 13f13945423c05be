"""LoRA through the runtime: no copy of the base for the reference, adapters-only weight sync,
checkpoints of adapters and their optimizer state, colocated and disaggregated runs."""

import json
import os

import jax
import numpy as np
from flax import nnx

from configs import arith_disagg, arith_tiny
from knitjax import sharding
from knitjax.config import from_config_dict
from knitjax.models import lora
from knitjax.models.transformer import Transformer
from knitjax.run import train
from knitjax.runtime import builder
from knitjax.runtime.weight_sync import WeightSync
from knitjax.train.checkpoint import Checkpointer
from tests import tiny


def lora_config(steps=2, **train_fields):
  c = arith_tiny.get_config("lora")
  c.admission.quotas = {"arith": 8}
  c.rollout.group_size = 4
  c.loop.steps = steps
  c.loop.log_every = 1
  c.checkpoint.every_steps = 1
  tiny.set_fields(c, **train_fields)
  return c


def _leaves_by_path(state):
  return {k: v.get_value() for k, v in nnx.to_flat_state(state)}


def test_trainer_optimizes_adapters_and_reuses_the_base_as_reference():
  cfg = from_config_dict(lora_config(kl_coef=0.05))
  mesh = builder.build_mesh(cfg)
  graphdef, params = builder.build_model(cfg, mesh)
  state, _, _, frozen = builder.build_trainer(cfg, graphdef, params, mesh)
  adapters, base = lora.split(params)
  assert jax.tree.structure(state.params) == jax.tree.structure(adapters)
  # The step's extra argument is the base itself (the same arrays): no copy for the reference.
  got, want = _leaves_by_path(frozen), _leaves_by_path(base)
  assert got.keys() == want.keys() and all(got[k] is want[k] for k in got)
  assert lora.tree_bytes(state.opt_state) < 3 * lora.tree_bytes(adapters)


def test_weight_sync_publishes_only_adapters():
  cfg = from_config_dict(lora_config())
  devices = jax.devices()
  train_mesh = sharding.make_mesh((-1, 1, 1), devices=devices[:2])
  rollout_mesh = sharding.make_mesh((-1, 1, 1), devices=devices[2:4])
  graphdef, params = builder.build_model(cfg, train_mesh)
  adapters, base = lora.split(params)
  adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # as after some updates
  placed = jax.device_put(base, sharding.state_shardings(base, rollout_mesh))
  sync = WeightSync(sharding.state_shardings(adapters, rollout_mesh), base=placed)
  sync.publish(adapters, 3)
  sync.wait()
  assert sync.published_bytes == lora.tree_bytes(adapters) < lora.tree_bytes(base)
  version, policy = sync.take_newer(None)
  assert version == 3
  assert {x.sharding.mesh for x in jax.tree.leaves(policy)} == {rollout_mesh}
  tokens = np.arange(12, dtype=np.int32).reshape(2, 6) % 16
  positions, valid = np.tile(np.arange(6), (2, 1)), np.ones((2, 6), bool)
  forward = jax.jit(lambda p: nnx.merge(graphdef, p)(tokens, positions, valid))
  np.testing.assert_allclose(
    forward(policy), forward(lora.combine(base, adapters)), rtol=1e-5, atol=1e-5
  )


def test_checkpoint_round_trip_of_adapters_and_optimizer_state(tmp_path):
  cfg = from_config_dict(lora_config())
  mesh = builder.build_mesh(cfg)
  _, state, *_ = builder.init_state(cfg, mesh)
  saved = jax.tree.map(lambda x: x + np.asarray(3, x.dtype), state)  # as after some updates
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(1, saved, {"version": 1})
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path))
  restored, meta = ckpt.restore(state)  # into a fresh run's state: fresh adapters
  ckpt.close()
  assert meta == {"version": 1}
  assert jax.tree.structure(restored) == jax.tree.structure(saved)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
    np.testing.assert_array_equal(a, b)
    assert a.sharding == b.sharding


# Two short training runs (about 30 s on an idle machine).
def test_lora_run_checkpoints_adapters_and_resumes(tmp_path):
  workdir = str(tmp_path)
  config = lora_config(steps=2)
  train(from_config_dict(config), workdir)
  cfg = from_config_dict(config)
  mesh = builder.build_mesh(cfg)
  _, state, *_ = builder.init_state(cfg, mesh)
  ckpt = Checkpointer(workdir)
  restored, meta = ckpt.restore(state)
  ckpt.close()
  assert meta["version"] == 2
  # The checkpoint holds the adapters (trained: B moved off zero) and their optimizer state.
  assert jax.tree.structure(restored.params) == jax.tree.structure(state.params)
  b = [v for (*_, n), v in _leaves_by_path(restored.params).items() if n == "b"]
  assert b and all(np.abs(np.asarray(x)).max() > 0 for x in b)
  mu = jax.tree.leaves(restored.opt_state)
  assert any(np.abs(np.asarray(x)).max() > 0 for x in mu if np.ndim(x))
  config.loop.steps = 3
  train(from_config_dict(config), workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2, 3]


def test_lora_runs_disaggregated_publishing_adapters(tmp_path):
  c = arith_disagg.get_config("quick")
  c.model.update(lora_rank=4, lora_alpha=8.0)
  train(from_config_dict(c), str(tmp_path))
  timings = json.loads((tmp_path / "timings.json").read_text())
  model = from_config_dict(c).model
  abstract = nnx.state(nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0))))
  adapters = lora.split(abstract)[0]
  assert timings["weight_publish_bytes_mean"] == lora.tree_bytes(adapters)
  with open(tmp_path / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  assert rows[-1]["rollout_version"] >= 1 and rows[-1]["groups_lost"] == 0
