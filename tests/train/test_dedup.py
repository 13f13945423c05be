"""Encoder dedup: exact gradients against the naive path, encoder counts, the custom-VJP gather.

Exactness criterion (float32): for each of the encoder (vision), projector and backbone (lm), the
relative error of the whole gradient, ||g_dedup - g_naive|| / ||g_naive||, is at most 1e-5, and so
is that of every param whose gradient is not tiny next to its part's (>= 1e-3 of the part norm).
The exception is needed for the key biases: attention softmax is invariant to adding q.b_k to
every score of a query, so their exact gradient is 0 and both paths return float32 noise.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from knitjax import sharding
from knitjax.models.vlm import VLM
from knitjax.train import losses, mm_step
from knitjax.train.batch import make_batch, pad_rows
from knitjax.train.dedup import dedup_gather
from knitjax.train.step import StepHParams
from tests.tiny import TINY, TINY_VISION

LM, VC = TINY, TINY_VISION
IMG, P_LEN, N_NEW = 3, 8, 4
G = 4
# Five groups over three unique images: groups 0 and 3 share image 0, groups 1 and 4 image 1;
# group 2 has image 2. Group 5 is text only (no image, image_index -1).
GROUP_IMAGE = (0, 1, 2, 0, 1, -1)
HP = StepHParams(loss=losses.LossConfig(entropy_coef=0.01, kl_coef=0.05), max_new_tokens=N_NEW)


def _minibatch(seed=0):
  """Rows of 6 groups of G, shuffled so that every group's members spread over micro-batches."""
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (3, VC.image_size, VC.image_size, 3)).astype(np.uint8)
  prompts, responses, logps, index = [], [], [], []
  for image in GROUP_IMAGE:
    head = [1] + [IMG] * VC.num_patches if image >= 0 else [1]
    for _ in range(G):
      tail = rng.integers(4, 32, rng.integers(1, 3))
      prompts.append(np.concatenate([head, tail]).astype(np.int32))
      n = rng.integers(1, N_NEW + 1)
      responses.append(rng.integers(4, 32, n).astype(np.int32))
      logps.append(rng.normal(-3.0, 0.5, n).astype(np.float32))
      index.append(image)
  rows = len(prompts)
  batch = make_batch(
    pad_rows(prompts, responses, logps),
    rng.normal(size=rows).astype(np.float32),
    prompt_len=P_LEN,
    max_new_tokens=N_NEW,
    pad_id=0,
  )
  batch["image_index"] = np.asarray(index, np.int32)
  perm = rng.permutation(rows)
  batch = {k: v[perm] for k, v in batch.items()}
  batch["images"] = images
  return batch


def _grads(mesh, batch, micro_batches, *, dedup, remat=False):
  graphdef, params = sharding.init_sharded(
    lambda: VLM(LM, VC, image_token_id=IMG, rngs=nnx.Rngs(0)), mesh
  )
  ref = jax.tree.map(lambda x: 0.9 * x, params)
  host = mm_step.prepare_batch(
    batch, micro_batches, shards=mm_step.batch_shards(mesh), row_images=not dedup
  )
  dev = jax.device_put(host, mm_step.batch_shardings(mesh))
  fn = jax.jit(
    lambda p, b, r: mm_step.mm_value_and_grad(
      p, b, graphdef=graphdef, hparams=HP, encoder_dedup=dedup, remat_encoder=remat, ref_params=r
    )
  )
  with jax.set_mesh(mesh):
    loss, sums, grads, counts = fn(params, dev, ref)
  return jax.device_get((loss, sums, grads, counts))


def _assert_grads_match(got, want, tol=1e-5):
  for part in ("vision", "projector", "lm"):
    a, b = jax.tree.leaves(want[part]), jax.tree.leaves(got[part])
    assert len(a) == len(b)
    part_norm = np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in a))
    pairs = list(zip(a, b, strict=True))
    diff = np.sqrt(sum(np.sum(np.square(x - y, dtype=np.float64)) for x, y in pairs))
    assert part_norm > 0 and diff <= tol * part_norm, (part, diff / part_norm)
    for x, y in pairs:
      norm = np.linalg.norm(x)
      if norm >= 1e-3 * part_norm:
        assert np.linalg.norm(x - y) <= tol * norm, (part, np.linalg.norm(x - y) / norm)


@pytest.fixture(scope="module")
def mesh1():
  return sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def naive(mesh1):
  """The baseline: naive path, 2 micro-batches."""
  return _grads(mesh1, _minibatch(), 2, dedup=False)


def test_dedup_gather_forward_and_scatter_add_backward():
  unique = jnp.arange(12.0).reshape(3, 4)
  index = jnp.array([2, 0, -1, 2, 2])
  rows, vjp = jax.vjp(lambda u: dedup_gather(u, index), unique)
  want = np.stack([unique[2], unique[0], np.zeros(4), unique[2], unique[2]])
  np.testing.assert_array_equal(rows, want)
  ct = jnp.arange(20.0).reshape(5, 4) + 1.0
  (ct_unique,) = vjp(ct)
  # Row 2 (no image) sends nothing back; image 2 collects rows 0, 3 and 4; image 1 nothing.
  np.testing.assert_array_equal(ct_unique, np.stack([ct[1], 0 * ct[1], ct[0] + ct[3] + ct[4]]))


def test_naive_path_encodes_every_row_in_every_micro_batch(naive):
  counts = naive[3]
  rows = len(GROUP_IMAGE) * G
  # Policy and reference encoders each take all 24 rows' images; one backward per micro-batch.
  assert counts["encoder_images_encoded"] == 2 * rows == 48
  assert counts["encoder_images_ref"] == rows
  assert counts["encoder_images_recomputed"] == 0
  assert counts["encoder_backward_passes"] == 2
  assert counts["encoder_images_backward"] == rows


@pytest.mark.parametrize(
  ("micro_batches", "remat"),
  [(1, False), (3, False), (8, True)],
)
def test_dedup_gradients_equal_naive(mesh1, naive, micro_batches, remat):
  """Across micro-batch counts (and with the encoder rematerialised): group members split over
  micro-batches, images shared by groups, a text-only group, KL to a reference, entropy bonus."""
  loss0, sums0, grads0, _ = naive
  loss, sums, grads, counts = _grads(mesh1, _minibatch(), micro_batches, dedup=True, remat=remat)
  np.testing.assert_allclose(loss, loss0, rtol=1e-5)
  np.testing.assert_allclose(sums["kl_sum"], sums0["kl_sum"], rtol=1e-5)
  _assert_grads_match(grads, grads0)
  # The 3 unique images once through the policy encoder (again in the backward with remat) and
  # once through the reference's; one encoder backward.
  recomputed = 3 if remat else 0
  assert counts["encoder_images_encoded"] == 3 + 3 + recomputed
  assert counts["encoder_images_ref"] == 3
  assert counts["encoder_images_recomputed"] == recomputed
  assert counts["encoder_backward_passes"] == 1
  assert counts["encoder_images_backward"] == 3


def _log_encoder_calls(monkeypatch):
  """Logs every encoder forward and backward as it executes (host callbacks), apart from the
  step's own counting: ("forward", N) each time `VLM.encode_images` runs on N images (a
  rematerialised forward runs, and logs, again in the backward), ("backward", N) each time a
  cotangent flows back into its features."""
  log = []
  encode = VLM.encode_images

  def record(kind, n):
    jax.debug.callback(lambda: log.append((kind, n)))

  @jax.custom_vjp
  def mark(feats):
    return feats

  def mark_bwd(_, ct):
    record("backward", ct.shape[0])
    return (ct,)

  mark.defvjp(lambda feats: (feats, None), mark_bwd)

  def logged_encode(self, images):
    record("forward", images.shape[0])
    return mark(encode(self, images))

  monkeypatch.setattr(VLM, "encode_images", logged_encode)
  return log


@pytest.mark.parametrize(
  ("dedup", "micro_batches", "remat"),
  [(False, 2, False), (True, 3, True), (True, 3, False)],
)
def test_counts_are_the_encoder_calls_that_ran(mesh1, monkeypatch, dedup, micro_batches, remat):
  """The step's counts against an independent log of the encoder calls executed, with a frozen
  reference encoder (forwards, no backward) and a rematerialised one (forward run twice)."""
  log = _log_encoder_calls(monkeypatch)
  counts = _grads(mesh1, _minibatch(), micro_batches, dedup=dedup, remat=remat)[3]
  jax.effects_barrier()
  forwards = [n for kind, n in log if kind == "forward"]
  backwards = [n for kind, n in log if kind == "backward"]
  assert forwards and backwards
  assert counts["encoder_images_encoded"] == sum(forwards)
  assert counts["encoder_backward_passes"] == len(backwards)
  assert counts["encoder_images_backward"] == sum(backwards)
  # Naive: 2 micro-batches x (12 policy + 12 reference images), 2 backwards of 12 images.
  # Dedup + remat: 3 policy, 3 reference, 3 recomputed; 1 backward of 3 images.
  # Dedup: 3 policy, 3 reference; 1 backward of 3 images.
  want = {(False, False): (48, 2, 24), (True, True): (9, 1, 3), (True, False): (6, 1, 3)}
  assert (sum(forwards), len(backwards), sum(backwards)) == want[dedup, remat]


def test_padded_images_are_encoded_and_counted(mesh1):
  batch = _minibatch()
  host = mm_step.prepare_batch(batch, 2, num_images=5, shards=4)
  assert host["images"].shape[0] == 8  # 5 rounded up to a multiple of 4 shards
  np.testing.assert_array_equal(host["images"][:3], batch["images"])
  assert not host["images"][3:].any()
  assert host["image_index"].shape == (2, 12)


def test_dedup_on_sharded_mesh_equals_naive_single_device(naive):
  """(2, 2, 2) mesh of 8 fake devices: params FSDP + tensor sharded, rows and images split."""
  mesh8 = sharding.make_mesh((2, 2, 2))
  loss0, _, grads0, _ = naive
  loss, _, grads, counts = _grads(mesh8, _minibatch(), 3, dedup=True)
  np.testing.assert_allclose(loss, loss0, rtol=1e-5)
  _assert_grads_match(grads, grads0)
  # 3 unique images padded to 4 (one per batch shard): 4 encoded by policy and reference each,
  # still not 24.
  assert counts["encoder_images_encoded"] == 8
  assert counts["encoder_images_ref"] == 4
  assert counts["encoder_images_backward"] == 4


def test_fetch_minibatch_gives_each_unique_image_once():
  """Storage -> trainer row_spec: an image shared by groups on two storage units arrives once."""
  from knitjax.tasks import count_images
  from knitjax.tasks.prompts import Prompt
  from knitjax.transfer.access import RowSpec, fetch_minibatch
  from knitjax.transfer.admission import MiniBatch
  from knitjax.transfer.assembly import assemble_group
  from knitjax.transfer.storage import InProcessStorageUnit, StorageLimits

  tok = count_images.make_tokenizer()
  a, b = (count_images.draw(c, np.random.default_rng(c))[0] for c in (3, 5))
  text = "@" * 16 + "how many?"
  prompts = [
    Prompt(prompt_id=i, cls="count", text=text, tokens=tok.encode(text), answer="3", image=im)
    for i, im in enumerate([a, a.copy(), b])
  ] + [
    Prompt(prompt_id=3, cls="count", text="how many?", tokens=tok.encode("how many?"), answer="0")
  ]
  limits = StorageLimits(vocab_size=tok.vocab_size, max_seq_len=32, max_bytes=1 << 20)
  units = {0: InProcessStorageUnit(limits, unit_id=0), 1: InProcessStorageUnit(limits, unit_id=1)}
  metas = []
  for gid, (prompt, unit) in enumerate(zip(prompts, (0, 1, 0, 1), strict=True)):
    group = assemble_group(
      prompt,
      np.full((G, 2), tok.eos_id, np.int32),
      np.ones(G, np.int32),
      np.zeros((G, 2), np.float32),
      group_id=gid,
      version=0,
      reward_fn=count_images.exact_reward,
      tokenizer=tok,
      storage_unit=unit,
    )
    units[unit].put(gid, group.payload, images=group.images)
    metas.append(group.meta)
  assert metas[0].image_hashes == metas[1].image_hashes != metas[2].image_hashes
  assert metas[3].image_hashes == ()
  batch, info = fetch_minibatch(
    MiniBatch(step=0, index=0, groups=tuple(metas)),
    units,
    RowSpec(estimator="grpo", prompt_len=26, max_new_tokens=2, pad_id=0),
  )
  np.testing.assert_array_equal(batch["images"], np.stack([a, b]))
  np.testing.assert_array_equal(batch["image_index"], [0] * 8 + [1] * 4 + [-1] * 4)
  assert info["unique_images"] == 2


def test_batch_shardings_follow_the_batch_rule():
  P = jax.sharding.PartitionSpec
  specs = {k: s.spec for k, s in mm_step.batch_shardings(sharding.make_mesh((2, 2, 2))).items()}
  assert specs.pop("images") == P(("data", "fsdp"))
  assert set(specs.values()) == {P(None, ("data", "fsdp"))}
