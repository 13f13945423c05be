"""Checkpointer: fallback past damaged checkpoints, and refusing another model's checkpoint."""

import glob
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from knitjax.train.checkpoint import Checkpointer


def _state(step, a_shape=(4, 3)):
  return {
    "params": {"a": jnp.full(a_shape, float(step)), "b": {"k": jnp.arange(5.0) + step}},
    "count": jnp.int32(step),
  }


def _save(workdir, steps, keep=2):
  ckpt = Checkpointer(workdir, keep=keep)
  for s in steps:
    ckpt.save(s, _state(s), {"version": 2 * s})
  ckpt.close()


def _restore(workdir, target=None):
  ckpt = Checkpointer(workdir)
  try:
    state, meta = ckpt.restore(_state(0) if target is None else target)
    return state, meta, ckpt.restored_step, ckpt
  finally:
    ckpt.close()


def _truncate(pattern):
  files = [f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)]
  assert files, pattern
  for f in files:
    with open(f, "r+b") as fh:
      fh.truncate(os.path.getsize(f) // 2)


def _write(path, text):
  with open(path, "w") as f:
    f.write(text)


DAMAGES = {
  "truncated_arrays": lambda d: _truncate(f"{d}/state/d/*"),
  "truncated_tree_metadata": lambda d: _truncate(f"{d}/state/_METADATA"),
  "truncated_ocdbt_manifest": lambda d: _truncate(f"{d}/state/manifest.ocdbt"),
  "missing_state": lambda d: shutil.rmtree(f"{d}/state"),
  "missing_meta": lambda d: shutil.rmtree(f"{d}/meta"),
  "bad_meta_json": lambda d: _write(f"{d}/meta/metadata", '{"vers'),
  "meta_not_an_object": lambda d: _write(f"{d}/meta/metadata", "[1, 2]"),
  "bad_orbax_step_metadata": lambda d: _write(f"{d}/_CHECKPOINT_METADATA", '{"item_h'),
  "empty_folder": lambda d: [shutil.rmtree(d), os.makedirs(d)],
}


def test_restores_the_newest_checkpoint(tmp_path):
  _save(str(tmp_path), (1, 2, 3))
  state, meta, step, _ = _restore(str(tmp_path))
  assert step == 3 and meta == {"version": 6}
  np.testing.assert_array_equal(state["params"]["a"], np.full((4, 3), 3.0))
  np.testing.assert_array_equal(state["params"]["b"]["k"], np.arange(5.0) + 3)


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_newest_falls_back_to_the_previous_one(tmp_path, caplog, damage):
  workdir = str(tmp_path)
  _save(workdir, (1, 2, 3))  # keep=2 retains 2 and 3
  newest = os.path.join(workdir, "checkpoints", "3")
  DAMAGES[damage](newest)
  with caplog.at_level(logging.WARNING):
    state, meta, step, ckpt = _restore(workdir)
  assert step == 2 and meta == {"version": 4}
  np.testing.assert_array_equal(state["params"]["a"], np.full((4, 3), 2.0))
  warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any(f"checkpoint {newest} is damaged" in m for m in warned), warned
  # Kept for inspection, out of orbax's sight: not deleted, not counted by `keep`.
  assert not os.path.exists(newest)
  assert os.path.isdir(os.path.join(workdir, "checkpoints_damaged", "3"))
  assert ckpt.latest_step() == 2


def test_training_on_after_a_fallback_saves_the_steps_again(tmp_path):
  workdir = str(tmp_path)
  _save(workdir, (2, 4))
  _truncate(os.path.join(workdir, "checkpoints", "4", "state", "d", "*"))
  ckpt = Checkpointer(workdir, keep=2)
  ckpt.restore(_state(0))
  assert ckpt.restored_step == 2
  for s in (3, 4):  # at or before the damaged step 4: orbax would skip these if it still saw 4
    ckpt.save(s, _state(s), {"version": 2 * s})
  ckpt.close()
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3", "4"]
  state, meta, step, _ = _restore(workdir)
  assert step == 4 and meta == {"version": 8}
  np.testing.assert_array_equal(state["params"]["a"], np.full((4, 3), 4.0))


def test_a_second_damaged_copy_of_a_step_is_kept_too(tmp_path):
  workdir = str(tmp_path)
  for _ in range(2):
    _save(workdir, (1, 2, 3))
    shutil.rmtree(os.path.join(workdir, "checkpoints", "3", "state"))
    assert _restore(workdir)[2] == 2
    shutil.rmtree(os.path.join(workdir, "checkpoints"))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints_damaged"))) == ["3", "3.1"]


def test_no_intact_checkpoint_is_one_sentence_naming_each_folder(tmp_path):
  workdir = str(tmp_path)
  _save(workdir, (1, 2))
  folders = [os.path.join(workdir, "checkpoints", s) for s in ("1", "2")]
  shutil.rmtree(os.path.join(folders[0], "state"))
  _write(os.path.join(folders[1], "meta", "metadata"), "{")
  with pytest.raises(ValueError) as e:
    _restore(workdir)
  msg = str(e.value)
  assert msg.startswith(f"no intact checkpoint to resume from in {workdir}/checkpoints: ")
  assert f"{folders[1]} (JSONDecodeError: " in msg and f"{folders[0]} (KeyError: " in msg
  assert msg.index(folders[1]) < msg.index(folders[0])  # newest first
  assert msg.endswith("or move them away to start afresh.") and "\n" not in msg
  # Nothing is moved when nothing could be restored.
  assert all(os.path.isdir(f) for f in folders)
  assert not os.path.exists(os.path.join(workdir, "checkpoints_damaged"))


def test_an_explicit_damaged_step_does_not_fall_back(tmp_path):
  workdir = str(tmp_path)
  _save(workdir, (1, 2))
  shutil.rmtree(os.path.join(workdir, "checkpoints", "2", "state"))
  ckpt = Checkpointer(workdir)
  with pytest.raises(ValueError, match=r"checkpoints/2 \(KeyError: "):
    ckpt.restore(_state(0), step=2)
  with pytest.raises(FileNotFoundError, match="no checkpoint of step 7 found in"):
    ckpt.restore(_state(0), step=7)
  ckpt.close()


def test_no_checkpoint_is_file_not_found(tmp_path):
  with pytest.raises(FileNotFoundError, match="no checkpoint found in"):
    _restore(str(tmp_path))


def test_another_models_shapes_are_one_sentence(tmp_path):
  workdir = str(tmp_path)
  _save(workdir, (1, 2))
  with pytest.raises(ValueError) as e:
    _restore(workdir, target=_state(0, a_shape=(2, 3)))
  folder = os.path.join(workdir, "checkpoints", "2")
  assert str(e.value) == (
    f"checkpoint {folder} was written by a different model: params/a has shape (4, 3), this "
    "run's model has (2, 3); resume with the model config that wrote it or start in a new workdir."
  )
  # Refusing is not damage: the checkpoint stays where it is.
  assert os.path.isdir(folder)


def test_another_models_arrays_are_named(tmp_path):
  workdir = str(tmp_path)
  _save(workdir, (1,))
  target = _state(0)
  del target["params"]["b"]
  target["params"]["layers_1"] = {"w": jnp.zeros((3,)), "v": jnp.zeros((3,))}
  with pytest.raises(ValueError) as e:
    _restore(workdir, target=target)
  msg = str(e.value)
  assert "was written by a different model: " in msg
  assert "it lacks params/layers_1/v (and 1 more), which this run's model has" in msg
  assert "it has params/b/k, which this run's model lacks" in msg


def _sharded(step, devices):
  """A state whose arrays are split over ``devices`` along their first axis."""
  mesh = jax.make_mesh((devices,), ("d",), devices=jax.devices()[:devices])
  on = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  state = {"params": {"w": jnp.arange(32.0).reshape(8, 4) + step}, "mu": jnp.arange(8.0) * step}
  return jax.device_put(state, on)


def test_a_checkpoint_resumes_on_another_number_of_devices(tmp_path):
  # Written over 2 devices, restored onto 4 (and back onto 1): the values are the saved ones,
  # laid out as the target asks, and the checkpointer says it resharded, naming both layouts.
  workdir = str(tmp_path)
  ckpt = Checkpointer(workdir)
  ckpt.save(3, _sharded(3, 2), {"version": 6})
  ckpt.close()
  for devices in (4, 1):
    target = _sharded(0, devices)
    ckpt = Checkpointer(workdir)
    state, meta = ckpt.restore(target)
    ckpt.close()
    assert meta == {"version": 6}  # the layout note stays inside the checkpointer
    want = _sharded(3, 2)
    leaves = zip(*map(jax.tree.leaves, (state, want, target)), strict=True)
    for got, ref, t in leaves:
      np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
      assert got.sharding == t.sharding
      assert len(got.addressable_shards) == devices
    assert ckpt.resharded == (
      {"processes": 1, "devices": 2},
      {"processes": 1, "devices": devices},
    )
