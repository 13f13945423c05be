"""Multimodal transfer: the centralized baseline and on-demand access with several consumers.

Both give the trainer the same update (the baseline only moves more bytes, later): a driver's
gather materialises every row's own image, on-demand consumers fetch each unique image once.
"""

import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from knitjax import sharding
from knitjax.models.vlm import VLM
from knitjax.train import layouts, losses, mm_step
from knitjax.train.step import StepHParams, host_metrics, init_train_state
from knitjax.transfer import centralized
from knitjax.transfer.access import RowSpec, consumer_batch, fetch_minibatch
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.feed import exposed_transfer
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.prepare import MiniBatchPreparer
from knitjax.transfer.storage import InProcessStorageUnit, StorageLimits, image_hash
from tests.tiny import TINY as LM  # the tiny VLM (tests/tiny.py)
from tests.tiny import TINY_VISION as VC

IMG, N_NEW, G = 3, 4, 4
P_LEN = 1 + VC.num_patches + 2
ROW_SPEC = RowSpec(estimator="grpo", prompt_len=P_LEN, max_new_tokens=N_NEW, pad_id=0)
# Eight groups over two storage units and five images: groups 0 and 5 share image 0 (on
# different units), group 3 is text only; two mini-batches of four groups.
GROUP_IMAGE = (0, 1, 2, -1, 3, 0, 4, 1)
HP = StepHParams(loss=losses.LossConfig(entropy_coef=0.01), max_new_tokens=N_NEW)


def _stored_step(seed=0):
  """A train step of two released mini-batches whose payloads and images are in two units."""
  rng = np.random.default_rng(seed)
  pixels = rng.integers(0, 256, (5, VC.image_size, VC.image_size, 3)).astype(np.uint8)
  limits = StorageLimits(vocab_size=LM.vocab_size, max_seq_len=P_LEN + N_NEW, max_bytes=1 << 22)
  storage = {u: InProcessStorageUnit(limits, unit_id=u) for u in range(2)}
  metas = []
  for gid, image in enumerate(GROUP_IMAGE):
    head = [1] + [IMG] * VC.num_patches if image >= 0 else [1]
    prompt = np.concatenate([head, rng.integers(4, 32, 2)]).astype(np.int32)
    lens = rng.integers(1, N_NEW + 1, G).astype(np.int32)
    mask = np.arange(N_NEW)[None] < lens[:, None]
    payload = {
      "prompt_tokens": np.tile(prompt, (G, 1)),
      "response_tokens": rng.integers(4, 32, (G, N_NEW)).astype(np.int32),
      "response_lengths": lens,
      "logprobs": np.where(mask, rng.normal(-3.0, 0.5, mask.shape), 0).astype(np.float32),
      "rewards": rng.integers(0, 2, G).astype(np.float32),
    }
    images = ()
    if image >= 0:
      payload["image_index"] = np.zeros(G, np.int32)
      images = (pixels[image],)
    unit = gid % 2
    storage[unit].put(gid, payload, images=images)
    metas.append(
      GroupMeta(
        group_id=gid,
        cls="count",
        gen_version=0,
        num_samples=G,
        prompt_tokens=(len(prompt),) * G,
        response_tokens=tuple(int(x) for x in lens),
        storage_unit=unit,
        image_hashes=tuple(image_hash(x) for x in images),
        reward_mean=float(payload["rewards"].mean()),
        reward_std=float(payload["rewards"].std()),
      )
    )
  step = [MiniBatch(0, j, tuple(metas[4 * j : 4 * j + 4])) for j in range(2)]
  return step, storage, pixels


def test_the_driver_materialises_every_rows_image_and_lays_out_the_same_rows():
  step, storage, pixels = _stored_step()
  gathered = centralized.gather_step(step, storage, ROW_SPEC)
  for mb, batch, info in zip(step, gathered.batches, gathered.infos, strict=True):
    want, want_info = fetch_minibatch(mb, storage, ROW_SPEC)
    for k in ("tokens", "positions", "valid", "targets", "loss_mask", "behavior_logp"):
      np.testing.assert_array_equal(batch[k], want[k])
    np.testing.assert_array_equal(batch["advantages"], want["advantages"])
    rows = len(batch["tokens"])
    assert batch["images"].shape == (rows, VC.image_size, VC.image_size, 3)
    has = want["image_index"] >= 0
    np.testing.assert_array_equal(batch["image_index"], np.where(has, np.arange(rows), -1))
    # Row r's own copy is the image the on-demand layout points row r at.
    np.testing.assert_array_equal(batch["images"][has], want["images"][want["image_index"][has]])
    assert not batch["images"][~has].any()  # rows without image: blanks
    assert info["unique_images"] == rows and want_info["unique_images"] < rows
    assert info["reward_mean"] == pytest.approx(want_info["reward_mean"])
  # One get per unit: every group's payload plus its images (the driver does not dedup).
  image_bytes = pixels[0].nbytes
  assert gathered.fetched_bytes[0] == sum(
    storage[0].get([g.group_id])[0].nbytes for mb in step for g in mb.groups if g.group_id % 2 == 0
  ) + image_bytes * sum(
    bool(g.image_hashes) for mb in step for g in mb.groups if g.storage_unit == 0
  )
  part = centralized.split_rows(gathered.batches[0], 2, 1)
  assert len(part["tokens"]) == 8 and part["images"].shape[0] == 8
  with pytest.raises(ValueError, match="cannot be split over 3 consumers"):
    centralized.split_rows(gathered.batches[0], 3, 0)


def _apply(mesh, batches, *, dedup):
  """Two optimizer updates of a tiny VLM from prepared device batches; returns params, counts."""
  graphdef, params = sharding.init_sharded(
    lambda: VLM(LM, VC, image_token_id=IMG, rngs=nnx.Rngs(0)), mesh
  )
  state, shardings = init_train_state(params, optax.sgd(0.5), mesh)
  step = mm_step.compile_mm_train_step(
    graphdef=graphdef,
    optimizer=optax.sgd(0.5),
    hparams=HP,
    state_shardings=shardings,
    mesh=mesh,
    encoder_dedup=dedup,
  )
  encoded = []
  with jax.set_mesh(mesh):
    for batch in batches:
      state, m = step(state, batch)
      encoded.append(host_metrics(m)["encoder_images_encoded"])
  return jax.device_get(state.params), encoded


@pytest.mark.parametrize("baseline_dedup", [False, True])
def test_centralized_and_on_demand_give_the_same_update(baseline_dedup):
  """Centralized + naive (or dedup) encoding equals on demand + dedup, update for update."""
  step, storage, _ = _stored_step()
  mesh = sharding.make_mesh((2, 1, 1), devices=jax.devices()[:2])
  on_demand = MiniBatchPreparer(storage, row_spec=ROW_SPEC, mesh=mesh, micro_batches=2)
  want, want_n = _apply(mesh, [on_demand(mb)[0] for mb in step], dedup=True)
  driver = centralized.CentralizedPreparer(
    storage,
    row_spec=ROW_SPEC,
    mesh=mesh,
    micro_batches=2,
    layout=layouts.Padded(row_images=not baseline_dedup),
  )
  got, got_n = _apply(mesh, [b for b, _ in driver(step)], dedup=baseline_dedup)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
  assert want_n == [4.0, 4.0]  # mini-batch 0: images 0, 1, 2 + a blank pad to 2 shards
  assert got_n == [16.0, 16.0]  # every row's copy (and none shared)


def test_consumers_fetch_their_own_images_and_the_update_is_unchanged():
  """Two on-demand consumers each fetch their groups' unique images; together, one update."""
  step, storage, _ = _stored_step()
  mb = step[0]
  mesh = sharding.make_mesh((2, 1, 1), devices=jax.devices()[:2])
  whole = MiniBatchPreparer(storage, row_spec=ROW_SPEC, mesh=mesh, micro_batches=2)(mb)[0]
  parts, infos = zip(
    *[
      consumer_batch(
        mb, storage, row_spec=ROW_SPEC, consumer=c, num_consumers=2, locality_slack=1e9
      )
      for c in range(2)
    ],
    strict=True,
  )
  # Each consumer holds its own unit's groups: images 0, 2 (unit 0: groups 0, 2) and 1 (unit
  # 1: groups 1, 3; 3 is text only), padded to the same 2 slots; indices into the global array.
  assert [i["unique_images"] for i in infos] == [2.0, 1.0]
  assert [len(p["images"]) for p in parts] == [2, 2]
  assert set(parts[1]["image_index"].tolist()) <= {-1, 2}
  split = [mm_step.prepare_batch(p, 2) for p in parts]
  assembled = {
    k: np.concatenate([s[k] for s in split], axis=0 if k == "images" else 1) for k in split[0]
  }
  placed = jax.device_put(assembled, mm_step.batch_shardings(mesh))
  got, _ = _apply(mesh, [placed], dedup=True)
  want, _ = _apply(mesh, [whole], dedup=True)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_centralized_feed_waits_for_the_whole_step_and_exposes_the_gather():
  step, _, _ = _stored_step()
  queue = list(step) * 2  # two steps

  def take(timeout):
    return queue.pop(0) if queue else None

  def prepare_step(mbs):
    time.sleep(0.05)
    return [(mb.index, {"n": 1.0}) for mb in mbs]

  feed = centralized.CentralizedFeed(take, prepare_step, count=4, minibatches=2)
  seen = []
  for _ in range(4):
    wanted = time.perf_counter()
    p = next(feed)
    seen.append((p.batch, exposed_transfer(p, wanted, time.perf_counter())["exposed_fetch_s"]))
  assert [b for b, _ in seen] == [0, 1, 0, 1]
  assert seen[0][1] >= 0.05 and seen[2][1] >= 0.05  # the step's gather, all exposed
  assert seen[1][1] == 0.0 and seen[3][1] == 0.0
  with pytest.raises(StopIteration):
    next(feed)
  with pytest.raises(ValueError, match="whole steps"):
    centralized.CentralizedFeed(take, prepare_step, count=3, minibatches=2)
