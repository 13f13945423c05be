"""A VLM policy in disaggregated mode: Ray rollout workers and a SIGKILL resume, images in flight.

Every group is one prompt's image and G responses to it: its storage unit holds the image once
(by content hash), each mini-batch encodes its unique images once, and a checkpoint keeps the
images of the groups it holds pending or queued, so a resumed run trains on them.
"""

import collections
import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from configs import count_vlm_tiny
from knitjax import records
from knitjax.config import from_config_dict
from knitjax.distributed import ray_workers
from knitjax.distributed.local_ray import ensure_ray
from knitjax.run import train
from knitjax.tasks import count_images
from knitjax.tasks.prompts import Prompt
from knitjax.train.checkpoint import Checkpointer
from knitjax.transfer.snapshot import restore_groups
from knitjax.transfer.storage import InProcessStorageUnit, StorageLimits, image_hash
from tests import tiny
from tests.runtime.test_disaggregated import check_run, read_jsonl
from tests.waiting import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMAGE_BYTES = count_images.IMAGE_SIZE**2 * 3  # uint8 RGB, as the task draws them
GROUPS_PER_MINIBATCH = 4


def vlm_config(*, steps: int, max_lag_steps: float = 0.5, **runtime):
  """count_vlm_tiny:quick, disaggregated: 8 groups (G=8) per step in 2 mini-batches of 4."""
  c = count_vlm_tiny.get_config("quick")
  tiny.set_fields(c, mode="disaggregated", steps=steps, max_lag_steps=max_lag_steps, **runtime)
  c.admission.update(quotas={"count": 2 * GROUPS_PER_MINIBATCH}, minibatches=2)
  c.rollout.slots = GROUPS_PER_MINIBATCH * c.rollout.group_size  # waves of 4 groups
  return c


def expected_image(prompt_id: int) -> np.ndarray:
  """The image of count_images example ``prompt_id`` (data seed 0, as the runs use)."""
  image, _ = count_images.draw(prompt_id % 10, np.random.default_rng([0, prompt_id]))
  return image


def check_dedup_counters(rows, *, train_devices: int = 4) -> None:
  # Each mini-batch's 4 groups bring 4 distinct images (prompts do not repeat within 1000 draws),
  # each encoded once for G=8 samples, with one encoder backward; the encoded count is padded up
  # to a multiple of the train mesh's batch shards. Rows average the 2 mini-batches.
  for r in rows:
    assert r["unique_images"] == GROUPS_PER_MINIBATCH, r
    assert (
      r["encoder_images_encoded"] == -(-GROUPS_PER_MINIBATCH // train_devices) * train_devices
    ), r
    assert r["encoder_backward_passes"] == 1, r


@pytest.fixture(scope="module")
def local_ray():
  """Local Ray started exactly as a run starts it (as tests/distributed/test_ray_faults.py does)."""
  ray = pytest.importorskip("ray")
  if ray.is_initialized():
    ray.shutdown()
  ensure_ray("")
  yield
  ray.shutdown()


def test_vlm_with_ray_rollout_workers_stores_each_image_once(local_ray, tmp_path, monkeypatch):
  """Two Ray rollout actors, each writing to its own Ray storage unit: quotas, conservation and
  encoder dedup as in process; each unit holds one image per group, not one per sample."""
  from knitjax.distributed.ray_rollout import RayRollout
  from knitjax.distributed.ray_storage import RayStorageUnit

  c = vlm_config(steps=2, rollout_workers=2)
  pools = []
  build_rollout = ray_workers.ray_rollout

  def capture(*args, **kwargs):
    pools.append(build_rollout(*args, **kwargs))
    return pools[-1]

  monkeypatch.setattr(ray_workers, "ray_rollout", capture)
  seen = {}

  def on_step(step, metrics):  # the units are actors, gone when the run ends: look now
    (pool,) = pools
    units = pool.storage
    if step == 1:  # the rollout runs ahead meanwhile: look while the units hold groups
      wait_until(
        lambda: sum(u.stats()["groups"] for u in units.values()) >= GROUPS_PER_MINIBATCH,
        what="the storage units holding a mini-batch of groups",
      )
    seen[step] = ({i: u.stats() for i, u in units.items()}, pool.pids()["storage"])

  train(from_config_dict(c), str(tmp_path), on_step=on_step)
  rows = check_run(str(tmp_path), c)
  check_dedup_counters(rows, train_devices=len(jax.devices()))  # the rollout is in Ray: all train

  (pool,) = pools
  assert isinstance(pool, RayRollout)
  assert sorted(pool.storage) == [0, 1]
  assert all(isinstance(u, RayStorageUnit) for u in pool.storage.values())
  assert sorted(seen) == [1, 2]
  for step, (units, pids) in seen.items():
    assert len(set(pids)) == 2 and os.getpid() not in pids  # two actors, not this process
    row = rows[step - 1]
    for s in units.values():
      # One reference per group (its G samples share it) and no content stored twice: every
      # group held has its own prompt, hence its own image.
      assert s["image_refs"] == s["groups"] and s["images"] == s["groups"], s
      assert s["image_bytes"] == s["images"] * IMAGE_BYTES and s["image_dedup_hits"] == 0, s
      assert s["puts"] - s["releases"] == s["groups"] and s["release_misses"] == 0, s
      assert sum(s["rejected"].values()) == 0 and s["full"] == 0, s
    # Consumed groups were released by the unit that held them (the meta named it), once each;
    # the units still hold at least the groups pending (more while an actor's call runs).
    assert sum(s["releases"] for s in units.values()) == row["groups_consumed"]
    assert sum(s["groups"] for s in units.values()) >= row["groups_pending"]
    assert sum(s["puts"] for s in units.values()) >= row["groups_offered"]
  assert sum(s["images"] for s in seen[1][0].values()) >= GROUPS_PER_MINIBATCH
  # Both actors generated: the first wave (8 groups) is shared between the two idle actors.
  assert all(s["puts"] > 0 for s in seen[2][0].values())


def test_vlm_sigkill_resume_keeps_the_images_of_pending_groups(tmp_path):
  """Killed after a checkpoint that holds pending or queued image groups, resumed to the end:
  nothing lost or consumed twice, the snapshot's images are the prompts' own, and every resumed
  mini-batch still has one encoded image per group."""
  steps, kill_after, hold = 4, 2, GROUPS_PER_MINIBATCH
  workdir = str(tmp_path / "run")
  # The run's checkpoint snapshot waits until the rollout has offered `hold` groups past the
  # consumed ones (the depth bound allows 8 with max_lag_steps=1), so the checkpoint holds
  # images in flight whatever the thread timing; then the process kills itself once that
  # checkpoint is committed.
  script = textwrap.dedent(f"""
      import os, signal, time
      from knitjax.config import from_config_dict
      from knitjax.runtime import pipeline
      from knitjax.run import train
      from tests.runtime.test_vlm_disaggregated import vlm_config

      snapshot = pipeline.Pipeline.snapshot
      def held(pipe):
        with pipe.lock:
          queued = sum(len(mb.groups) for mb in pipe.queue.items())
          return len(pipe.admission.pending()) + queued
      def waiting_snapshot(pipe):
        deadline = time.monotonic() + 120
        while held(pipe) < {hold} and pipe.thread.is_alive() and time.monotonic() < deadline:
          time.sleep(0.01)
        return snapshot(pipe)
      pipeline.Pipeline.snapshot = waiting_snapshot

      def on_step(step, metrics):
        if step == {kill_after}:
          done = os.path.join({workdir!r}, "checkpoints", str(step), "_CHECKPOINT_METADATA")
          deadline = time.monotonic() + 120
          while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.01)
          os.kill(os.getpid(), signal.SIGKILL)
      train(from_config_dict(vlm_config(steps={steps}, max_lag_steps=1.0)), {workdir!r},
            on_step=on_step)
  """)
  env = {**os.environ, "PYTHONPATH": REPO}
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True)
  assert proc.returncode == -9, proc.stderr.decode()[-3000:]
  assert Checkpointer(workdir).latest_step() == kill_after
  first_consumed = read_jsonl(workdir, "consumed.jsonl")
  first_offered = read_jsonl(workdir, "offered.jsonl")
  saved = ckpt_meta(workdir, kill_after)
  shutil.copytree(workdir, str(tmp_path / "at_kill"))

  # The checkpoint holds `hold` or more image groups pending or queued, with their payloads and
  # each group's image once, under the content hash of its prompt's own image.
  counters = saved["admission"]["counters"]
  prompt_of = {
    o["group_id"]: o["prompt_id"] for o in first_offered if o["seq"] <= counters["offered"]
  }
  held_ids = held_group_ids(saved)
  snap = saved["payloads"]
  assert sorted(g["group_id"] for g in snap["groups"]) == sorted(held_ids)
  assert len(held_ids) >= hold
  for g in snap["groups"]:
    (h,) = g["image_hashes"]
    assert h == image_hash(expected_image(prompt_of[g["group_id"]]))
  unit = InProcessStorageUnit(StorageLimits(vocab_size=23, max_seq_len=64, max_bytes=1 << 24))
  assert restore_groups({0: unit}, snap) == len(held_ids)
  s = unit.stats()
  assert s["groups"] == s["image_refs"] == s["images"] == len(held_ids)
  for g in snap["groups"]:
    (payload,) = unit.get([g["group_id"]])
    assert payload.num_samples == 8 and payload.image_index.tolist() == [0] * 8
    (image,) = unit.get_images(g["image_hashes"])
    np.testing.assert_array_equal(image, expected_image(prompt_of[g["group_id"]]))
  # Prompts still generating are kept with their images, to be generated again.
  for p in saved["generating"]:
    prompt = records.from_json(Prompt, p)
    np.testing.assert_array_equal(prompt.image, expected_image(prompt.prompt_id))

  config = vlm_config(steps=steps, max_lag_steps=1.0)
  train(from_config_dict(config), workdir)

  rows = check_run(workdir, config)  # quotas, versions, conservation, none consumed twice
  check_dedup_counters(rows)  # the resumed steps' mini-batches include the restored groups
  consumed = read_jsonl(workdir, "consumed.jsonl")
  offered = read_jsonl(workdir, "offered.jsonl")
  final = ckpt_meta(workdir, steps)
  assert [c for c in consumed if c["step"] < kill_after] == [
    c for c in first_consumed if c["step"] < kill_after
  ]
  ids = [g for c in consumed for g in c["group_ids"]]
  assert len(ids) == len(set(ids)), "a group was consumed twice"
  # The resumed run trained on the held groups first: their prompts, not regenerated ones.
  resumed_ids = [g for c in consumed if c["step"] >= kill_after for g in c["group_ids"]]
  assert set(held_ids) <= set(resumed_ids)
  final_prompt = {o["group_id"]: o["prompt_id"] for o in offered}
  assert all(final_prompt[g] == prompt_of[g] for g in held_ids)
  # Offer sequence numbers continue without gap or repeat; the history up to the checkpoint
  # is the first run's.
  assert [o["seq"] for o in offered] == list(range(1, len(offered) + 1))
  assert offered[: counters["offered"]] == first_offered[: counters["offered"]]
  regenerated = collections.Counter(p["prompt_id"] for p in saved["generating"])
  resumed = collections.Counter(
    o["prompt_id"] for o in offered if o["seq"] > counters["offered"]
  ) + collections.Counter(p["prompt_id"] for p in final["generating"])
  assert not regenerated - resumed  # every prompt generating at the checkpoint came back
  # offered = consumed + rejected + pending, as sets of group ids.
  pending = held_group_ids(final)
  rejected = [o["group_id"] for o in offered if o["rejected"]]
  assert sorted(ids + rejected + pending) == sorted(o["group_id"] for o in offered)
  assert rows[-1]["groups_lost"] == 0 and final["consumed"] == len(ids)


def ckpt_meta(workdir, step):
  with open(os.path.join(workdir, "checkpoints", str(step), "meta", "metadata")) as f:
    return json.load(f)


def held_group_ids(meta) -> list[int]:
  """Groups a checkpoint holds offered but not consumed: pending in the index or queued."""
  ids = [g["group_id"] for g in meta["admission"]["open"]]
  ids += [g["group_id"] for _, g in meta["admission"]["waiting"]]
  ids += [g["group_id"] for mb in meta["queued"] for g in mb["groups"]]
  return ids
