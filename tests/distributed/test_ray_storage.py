"""Storage units as Ray actors: same behaviour and errors as in process, fetched by consumers."""

import glob
import threading

import jax
import numpy as np
import pytest

ray = pytest.importorskip("ray")

from knitjax.distributed.ray_storage import RayStorageUnit  # noqa: E402
from knitjax.distributed.topology import choose  # noqa: E402
from knitjax.transfer.access import RowSpec, fetch_minibatch  # noqa: E402
from knitjax.transfer.admission import MiniBatch  # noqa: E402
from knitjax.transfer.group import GroupMeta  # noqa: E402
from knitjax.transfer.payload import GroupPayload, synthetic_payload  # noqa: E402
from knitjax.transfer.storage import StorageFull, StorageLimits  # noqa: E402
from knitjax.transfer.validation import PayloadError  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

VOCAB, P, N, G = 50, 4, 6, 3
LIMITS = StorageLimits(vocab_size=VOCAB, max_seq_len=P + N, max_bytes=1 << 20)


@pytest.fixture(scope="module")
def ray_temp(tmp_path_factory):
  """The temp folder of this module's Ray workers, where their units spill: its own, so a check
  of what a run leaves there does not see another test's units (pytest runs two at a time)."""
  return tmp_path_factory.mktemp("ray-workers-tmp")


@pytest.fixture(scope="module")
def ray_local(ray_temp):
  if ray.is_initialized():  # another test of this worker process left its Ray running
    ray.shutdown()
  ray.init(
    num_cpus=2,
    include_dashboard=False,
    log_to_driver=False,
    object_store_memory=1 << 28,
    runtime_env={"env_vars": {"TMPDIR": str(ray_temp)}},
  )
  yield
  ray.shutdown()


def _payload(seed):
  return synthetic_payload(
    np.random.default_rng(seed), group_size=G, prompt_len=P, response_len=N, vocab_size=VOCAB
  )


def test_put_get_release_and_errors_cross_the_actor(ray_local):
  unit = RayStorageUnit(LIMITS, unit_id=3)
  p = _payload(0)
  assert unit.put(7, p) > 0
  (got,) = unit.get([7])
  assert isinstance(got, GroupPayload)
  for name, x in p.items():
    np.testing.assert_array_equal(getattr(got, name), x, err_msg=name)
  # A GroupPayload goes in as it came out (pickled by Ray), validated again by the unit.
  assert unit.put(9, got) == got.nbytes
  np.testing.assert_array_equal(unit.get([9])[0].response_mask, p["response_mask"])
  bad = dict(p, response_tokens=p["response_tokens"] + VOCAB)  # ids outside the vocabulary
  with pytest.raises(PayloadError, match="field 'response_tokens'") as e:
    unit.put(8, bad)
  assert e.value.field == "response_tokens"
  with pytest.raises(KeyError, match=r"groups \[99\] are not held by storage unit 3"):
    unit.get([7, 99])
  s = unit.stats()
  assert s["groups"] == 2 and sum(s["rejected"].values()) == 1
  unit.release([7, 9])
  assert unit.stats()["groups"] == 0
  assert isinstance(unit.node_id, str) and unit.node_id
  unit.close()


def test_blocked_put_is_woken_by_a_release(ray_local):
  """Backpressure inside the actor: a put waits for room while a release still gets through."""
  p = _payload(1)
  size = sum(v.nbytes for v in p.values()) + G * 4  # + the stored prompt lengths
  limits = StorageLimits(
    vocab_size=VOCAB, max_seq_len=P + N, max_bytes=size, on_full="block", timeout_s=20
  )
  unit = RayStorageUnit(limits)
  unit.put(0, p)
  done = threading.Event()
  t = threading.Thread(target=lambda: (unit.put(1, _payload(2)), done.set()))
  t.start()
  # blocked inside the actor: it is queued there (a counter, not a hopeful sleep)
  wait_until(lambda: unit.stats()["waiting"] == 1, what="the put waiting in the actor")
  assert not done.is_set() and unit.stats()["groups"] == 1
  unit.release([0])
  assert done.wait(20)
  t.join()
  assert unit.stats()["groups"] == 1
  full = RayStorageUnit(
    StorageLimits(vocab_size=VOCAB, max_seq_len=P + N, max_bytes=size * 3 // 2, on_full="raise")
  )
  full.put(0, p)
  with pytest.raises(StorageFull):
    full.put(1, _payload(2))


def test_consumer_fetches_a_minibatch_from_two_ray_units(ray_local):
  units = {u: RayStorageUnit(LIMITS, unit_id=u) for u in (0, 1)}
  metas = []
  for gid in range(4):
    p = _payload(10 + gid)
    units[gid % 2].put(gid, p)
    metas.append(
      GroupMeta(
        group_id=gid,
        cls="a",
        gen_version=0,
        num_samples=G,
        prompt_tokens=(P,) * G,
        response_tokens=tuple(int(x) for x in p["response_lengths"]),
        storage_unit=gid % 2,
      )
    )
  mb = MiniBatch(0, 0, tuple(metas))
  row_spec = RowSpec(estimator="grpo", prompt_len=P, max_new_tokens=N, pad_id=0)
  batch, info = fetch_minibatch(mb, units, row_spec)
  assert batch["tokens"].shape == (4 * G, P + N)
  # The same groups in process give the same arrays.
  from knitjax.transfer.storage import InProcessStorageUnit

  local = {u: InProcessStorageUnit(LIMITS, unit_id=u) for u in (0, 1)}
  for gid in range(4):
    local[gid % 2].put(gid, _payload(10 + gid))
  expected, _ = fetch_minibatch(mb, local, row_spec)
  for k in expected:
    np.testing.assert_array_equal(batch[k], expected[k])


def test_colocated_run_with_ray_storage_units(ray_local, ray_temp, tmp_path):
  """The real loop, with its storage unit in a Ray actor, trains and releases every group."""
  from configs import arith_tiny
  from knitjax.config import from_config_dict
  from knitjax.runtime import colocated

  c = arith_tiny.get_config("quick")
  c.topology.storage = "ray"
  config = from_config_dict(c)
  out = colocated.run(config, str(tmp_path), choose(config))
  assert out["step"] == c.loop.steps and out["version"] == 2 * c.admission.minibatches
  assert not glob.glob(f"{ray_temp}/knitjax-storage*")  # the spill folder is gone with its unit


def test_colocated_run_with_ray_rollout_workers(ray_local, tmp_path):
  """Rollout in a Ray actor writing to a storage unit on its node; the trainer fetches from it."""
  from configs import arith_tiny
  from knitjax.config import from_config_dict
  from knitjax.rollout import contract
  from knitjax.runtime import builder, colocated

  c = arith_tiny.get_config("quick")
  c.topology.rollout_workers = 1
  config = from_config_dict(c)
  out = colocated.run(config, str(tmp_path), choose(config))
  assert out["step"] == c.loop.steps and out["version"] == 2 * c.admission.minibatches
  assert 0 <= out["reward_mean"] <= 1

  # The pool directly: metadata comes back, payloads stay in the worker's unit until released.
  prompts = builder.build_prompts(config)
  mesh = builder.build_mesh(config)
  graphdef, params = builder.build_model(config, mesh)
  pool = choose(config).rollout(config, graphdef, mesh, prompts)
  metas = contract.generate(
    pool, params, prompts.next({"arith": 3}), version=0, rng=jax.random.key(0), first_group_id=10
  )
  assert [m.group_id for m in metas] == [10, 11, 12]
  assert {m.storage_unit for m in metas} == {0} and all(m.gen_version == 0 for m in metas)
  unit = pool.storage[0]
  assert unit.stats()["groups"] == 3
  got = unit.get([11])[0].response_tokens
  assert got.shape[0] == config.rollout.group_size
  pool.close()


def test_disaggregated_run_with_ray_rollout_workers(ray_local, tmp_path):
  """Disaggregated mode drives Ray rollout actors through the same contract as in process:
  quotas per step, versions, conservation; payloads fetched from the actors' node-local units."""
  from knitjax.config import from_config_dict
  from knitjax.run import train
  from tests.runtime.test_disaggregated import check_run, quick_config

  c = quick_config(rollout_workers=2)
  train(from_config_dict(c), str(tmp_path))
  rows = check_run(str(tmp_path), c)
  # Units hold the pending groups plus groups an actor stored but has not returned yet (its call
  # still running): those count as generating and are regenerated on resume.
  last = rows[-1]
  held, pending = last["queue_storage_groups"], last["groups_pending"]
  assert pending <= held <= pending + last["queue_generating_groups"]
