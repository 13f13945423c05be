"""Resuming from faulty workdirs: damaged checkpoints, another model's, incomplete run states."""

import glob
import logging
import os

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from configs import arith_tiny
from knitjax import records
from knitjax.config import from_config_dict
from knitjax.models.transformer import Transformer
from knitjax.run import train
from knitjax.runtime.learner import Learner, RunState
from knitjax.runtime.metrics import read_metrics
from knitjax.train.checkpoint import Checkpointer
from knitjax.train.optimizer import make_optimizer
from knitjax.train.step import TrainState
from knitjax.transfer.staleness import StalenessTracker


def _learner(workdir, mode, state=None):
  state = {"w": jnp.zeros((3,))} if state is None else state
  return Learner(
    state, lambda s, b: (s, {}), checkpointer=Checkpointer(workdir), every_steps=1, mode=mode
  )


def _save_meta(workdir, meta, step=4):
  ckpt = Checkpointer(workdir)
  ckpt.save(step, {"w": jnp.ones((3,))}, meta)
  ckpt.close()


def _run_state(mode):
  run = RunState(mode=mode, version=8, staleness=StalenessTracker().state_dict())
  return records.to_json(run)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_a_complete_run_state_resumes(tmp_path, mode):
  _save_meta(str(tmp_path), _run_state(mode))
  learner = _learner(str(tmp_path), mode)
  run = learner.restore()
  learner.close()
  assert run.version == learner.version == 8
  assert float(learner.state["w"][0]) == 1.0


def test_a_run_state_without_a_needed_field_names_folder_and_field(tmp_path):
  meta = _run_state("disaggregated")
  del meta["consumed"]
  _save_meta(str(tmp_path), meta)
  learner = _learner(str(tmp_path), "disaggregated")
  with pytest.raises(ValueError) as e:
    learner.restore()
  learner.close()
  folder = os.path.join(str(tmp_path), "checkpoints", "4")
  assert str(e.value) == (
    f"checkpoint {folder} has no 'consumed' in its run state (meta), which a disaggregated run "
    "resumes from; it was written by an older knitjax or by another runtime mode, so resume it "
    "with the mode that wrote it or start in a new workdir."
  )


def test_an_old_colocated_run_state_resumes_colocated_but_not_disaggregated(tmp_path):
  # What colocated checkpoints held before RunState: no mode, no rollout fields.
  meta = {k: _run_state("")[k] for k in ("version", "next_group_id", "prompts", "admission")}
  meta["staleness"] = StalenessTracker().state_dict()
  _save_meta(str(tmp_path), meta)
  learner = _learner(str(tmp_path), "colocated")
  assert learner.restore().version == 8
  learner.close()
  learner = _learner(str(tmp_path), "disaggregated")
  with pytest.raises(ValueError, match=r"checkpoints/4 has no 'consumed', 'queued', 'payloads',"):
    learner.restore()
  learner.close()


def test_the_other_modes_checkpoint_is_still_refused(tmp_path):
  _save_meta(str(tmp_path), _run_state("disaggregated"))
  learner = _learner(str(tmp_path), "colocated")
  with pytest.raises(ValueError, match="come from a disaggregated run, but config.topology.mode"):
    learner.restore()
  learner.close()


def test_a_run_state_with_an_unknown_field_names_the_folder(tmp_path):
  _save_meta(str(tmp_path), {**_run_state("colocated"), "bogus": 1})
  learner = _learner(str(tmp_path), "colocated")
  with pytest.raises(ValueError, match=r"checkpoints/4 has a run state \(meta\) that cannot be "):
    learner.restore()
  learner.close()


def _tiny(**model):
  c = arith_tiny.get_config()
  c.model.update(model)
  return from_config_dict(c)


def _train_state(config):
  """A train state of ``config``'s model (zeros: only its tree and shapes matter here)."""

  def init():
    params = nnx.state(Transformer(config.model, rngs=nnx.Rngs(0)))
    return TrainState(params=params, opt_state=make_optimizer(config.optimizer).init(params))

  return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(init))


def test_another_models_checkpoint_is_one_sentence(tmp_path):
  workdir = str(tmp_path)
  ckpt = Checkpointer(workdir)
  ckpt.save(4, _train_state(_tiny()), _run_state("colocated"))
  ckpt.close()
  learner = _learner(workdir, "colocated", state=_train_state(_tiny()))
  assert learner.restore().version == 8  # the same model's tree matches the stored one
  learner.close()
  folder = os.path.join(workdir, "checkpoints", "4")
  for model, difference in [
    (
      {"d_model": 32},
      "params/blocks/0/attn/k_kernel/value has shape (64, 2, 16), this run's model has "
      "(32, 2, 16) (",
    ),
    ({"num_layers": 3}, "it lacks params/blocks/2/attn/k_kernel/value (and "),
    ({"num_layers": 1}, "it has params/blocks/1/attn/k_kernel/value (and "),
    (
      {"vocab_size": 12},
      "params/embedder/embedding/value has shape (16, 64), this run's model has (12, 64) (2 ",
    ),
  ]:
    learner = _learner(workdir, "colocated", state=_train_state(_tiny(**model)))
    with pytest.raises(ValueError) as e:
      learner.restore()
    learner.close()
    msg = str(e.value)
    assert msg.startswith(f"checkpoint {folder} was written by a different model: {difference}")
    assert msg.endswith("start in a new workdir.") and "\n" not in msg
    assert os.path.isdir(folder)  # refused, not treated as damage


def _config(steps):
  c = arith_tiny.get_config()
  c.admission.quotas = {"arith": 8}
  c.rollout.group_size = 4
  c.loop.steps = steps
  c.loop.log_every = 1
  c.checkpoint.every_steps = 1
  return from_config_dict(c)


def test_resume_falls_back_past_a_damaged_checkpoint_and_a_torn_metrics_line(tmp_path, caplog):
  workdir = str(tmp_path)
  train(_config(2), workdir)
  first = read_metrics(workdir)
  newest = os.path.join(workdir, "checkpoints", "2")
  for f in glob.glob(os.path.join(newest, "state", "d", "*")):
    os.truncate(f, os.path.getsize(f) // 2)
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
    f.write('{"step": 3, "reward_me')  # a crash while writing a later step's row

  with caplog.at_level(logging.WARNING):
    train(_config(2), workdir)  # falls back to step 1 and trains step 2 again
  warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any(m.startswith(f"checkpoint {newest} is damaged (") for m in warned), warned
  assert any("dropping the torn last line 3 of" in m for m in warned), warned
  rows = read_metrics(workdir)
  assert [r["step"] for r in rows] == [1, 2]
  for key in ("version", "reward_mean", "loss"):  # step 2 again, as it was the first time
    assert [r[key] for r in rows] == [r[key] for r in first]
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]
  assert os.listdir(os.path.join(workdir, "checkpoints_damaged")) == ["2"]


@pytest.mark.parametrize(
  "error",
  [
    OSError(28, "No space left on device"),  # a Python-level write (metadata, JSON)
    ValueError(  # what TensorStore's array writes raise through orbax's threads
      'RESOURCE_EXHAUSTED: Error writing "w/0" in OCDBT database: Failed to write 150917 bytes '
      "to file 7: No space left on device [os_error_code='28']"
    ),
  ],
)
def test_a_full_disk_during_a_save_is_one_sentence_and_no_partial_is_left(tmp_path, error):
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(1, {"w": jnp.ones((1000,))}, {"version": 1})
  ckpt.wait()
  real_wait = ckpt._manager.wait_until_finished
  partial = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-1765000000"

  def save(step, args):
    (partial / "state" / "d").mkdir(parents=True)
    (partial / "state" / "d" / "0").write_bytes(b"half")
    return True

  def wait():
    real_wait()
    if partial.exists():
      raise error

  ckpt._manager.save, ckpt._manager.wait_until_finished = save, wait
  ckpt.save(2, {"w": jnp.ones((1000,))}, {"version": 2})  # async: the error surfaces later
  with pytest.raises(ValueError) as e:
    ckpt.save(3, {"w": jnp.ones((1000,))}, {"version": 3})
  message = str(e.value)
  assert message.startswith(
    f"no space left on the device of {tmp_path / 'checkpoints'} for the checkpoint of step 2 "
    "(about 4,000 bytes of arrays; "
  )
  assert message.endswith("rerun the same command to resume from checkpoint 1.")
  assert "\n" not in message
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]  # the partial folder is gone
  ckpt.close()
  again = Checkpointer(str(tmp_path))
  state, meta = again.restore({"w": jnp.zeros((1000,))})
  again.close()
  assert meta == {"version": 1} and again.restored_step == 1
