"""Colocated runtime end to end: metrics, versions, staleness, checkpoints and resume."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np

from configs import arith_tiny
from knitjax.config import from_config_dict
from knitjax.run import train
from knitjax.train.checkpoint import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_config(steps=2, every=1, minibatches=2):
  c = arith_tiny.get_config()
  c.admission.quotas = {"arith": 8}
  c.admission.minibatches = minibatches
  c.rollout.group_size = 4
  c.loop.steps = steps
  c.loop.log_every = 1
  c.checkpoint.every_steps = every
  return c


def read_rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_two_steps_write_metrics_versions_and_staleness(tmp_path):
  workdir = str(tmp_path)
  train(from_config_dict(tiny_config()), workdir)
  rows = read_rows(workdir)
  assert [r["step"] for r in rows] == [1, 2]
  assert [r["version"] for r in rows] == [2, 4]  # M=2 optimizer updates per step
  for r in rows:
    for key in ("reward_mean", "loss", "tokens_per_s", "staleness_mean", "arch_staleness_max"):
      assert key in r and r[key] is not None
    # Colocated: mini-batch j is consumed j versions after generation, so staleness is j.
    assert r["staleness_max"] == 1 and r["staleness_mean"] == 0.5
    assert r["arch_staleness_max"] == 0
    assert r["num_seqs"] == 16  # 4 groups x G=4 per mini-batch
  assert os.path.exists(os.path.join(workdir, "reward.png"))
  assert os.listdir(os.path.join(workdir, "tb"))


def _params(workdir, config):
  from knitjax.runtime import builder

  cfg = from_config_dict(config)
  mesh = builder.build_mesh(cfg)
  _, state, *_ = builder.init_state(cfg, mesh)
  ckpt = Checkpointer(workdir)
  restored, meta = ckpt.restore(state)
  ckpt.close()
  return jax.device_get(restored.params), meta


def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
  """A run killed after its step-2 checkpoint resumes and ends like an uninterrupted run."""
  config = tiny_config(steps=4, every=2)
  straight = str(tmp_path / "straight")
  train(from_config_dict(config), straight)

  killed = str(tmp_path / "killed")
  script = textwrap.dedent(f"""
      import os, signal, time
      from configs import arith_tiny
      from knitjax.config import from_config_dict
      from knitjax.run import train
      c = arith_tiny.get_config()
      c.admission.quotas = {{"arith": 8}}; c.admission.minibatches = 2
      c.rollout.group_size = 4; c.loop.steps = 4; c.loop.log_every = 1
      c.checkpoint.every_steps = 2
      def on_step(step, metrics):
        if step == 3:
          # the async step-2 checkpoint is committed once its final folder exists (orbax
          # writes a temporary folder and renames it): wait for that file, not for a time
          done = os.path.join({killed!r}, "checkpoints", "2", "_CHECKPOINT_METADATA")
          deadline = time.monotonic() + 120
          while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.01)
          os.kill(os.getpid(), signal.SIGKILL)
      train(from_config_dict(c), {killed!r}, on_step=on_step)
  """)
  env = {**os.environ, "PYTHONPATH": REPO}
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True)
  assert proc.returncode == -9, proc.stderr.decode()[-2000:]
  assert Checkpointer(killed).latest_step() == 2
  assert [r["step"] for r in read_rows(killed)] == [1, 2, 3]

  train(from_config_dict(config), killed)  # resumes from step 2
  assert [r["step"] for r in read_rows(killed)] == [1, 2, 3, 4]  # step 3 is not duplicated
  p_straight, m_straight = _params(straight, config)
  p_killed, m_killed = _params(killed, config)
  assert m_killed["version"] == m_straight["version"] == 8
  assert m_killed["next_group_id"] == m_straight["next_group_id"]
  for a, b in zip(jax.tree.leaves(p_straight), jax.tree.leaves(p_killed), strict=True):
    np.testing.assert_array_equal(a, b)
  straight_rewards = [r["reward_mean"] for r in read_rows(straight)]
  assert [r["reward_mean"] for r in read_rows(killed)] == straight_rewards


def test_the_smallest_documented_temperature_trains(tmp_path):
  """Issue 47: ``--config.rollout.temperature=1.2e-38`` (docs/reliability.md: any T >= 1.18e-38)
  stopped at step 2 with a NaN log-prob blamed on the data; the trainer's logits / T overflowed
  and made the update NaN. Now both steps train and every metric is finite."""
  c = arith_tiny.get_config("quick")
  c.rollout.temperature = 1.2e-38
  workdir = str(tmp_path)
  train(from_config_dict(c), workdir)
  rows = read_rows(workdir)
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    for key in ("grad_norm", "param_norm", "loss", "entropy", "ratio_mean"):
      assert isinstance(r[key], float) and np.isfinite(r[key]), (key, r)
  assert rows[-1]["ratio_mean"] == 1.0  # the trainer's log-probs are the sampler's (0)
