"""Scaling the Ray rollout workers of a running run: the command's refusals, the run's watch, and
the elastic benchmark's quick run (1 -> 3 -> 1 Ray workers mid-run: quotas, depth bound and
conservation by group id hold, and the new workers generate groups)."""

import json
import os
import subprocess
import sys

import pytest

from knitjax.distributed import elastic

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _scale(workdir, n) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", "knitjax.scale", f"--workdir={workdir}", f"--rollout_workers={n}"],
    cwd=REPO,
    env={**os.environ, "PYTHONPATH": REPO},
    capture_output=True,
    text=True,
    timeout=60,
  )


def test_the_command_refuses_bad_input_in_one_sentence(tmp_path):
  r = _scale(tmp_path, 0)
  assert r.returncode == 1
  assert r.stderr.strip() == "error: --rollout_workers=0 is not allowed; give 1 or more."
  r = _scale(tmp_path / "nothing", 2)
  assert r.returncode == 1 and "holds no run (no .lock file there)" in r.stderr
  assert len(r.stderr.strip().splitlines()) == 1
  (tmp_path / ".lock").write_text("{}")  # a run, but one without Ray workers (no status file)
  r = _scale(tmp_path, 2)
  assert r.returncode == 1 and "has no Ray rollout workers to scale" in r.stderr
  assert not (tmp_path / elastic.REQUEST).exists()


class _Rollout:
  """What the watch asks of a Ray rollout."""

  def __init__(self, n=1):
    self.asked, self._members = [], {"asked": n, "working": [0], "joining": []}

  def scale(self, n):
    self.asked.append(n)
    self._members["asked"] = n

  def members(self):
    return dict(self._members)


def test_the_watch_applies_each_new_request_once_and_records_the_workers(tmp_path):
  (tmp_path / ".lock").write_text("{}")
  rollout = _Rollout()
  watch = elastic.ScaleWatch(str(tmp_path), rollout, 1)
  status = json.loads((tmp_path / elastic.STATUS).read_text())
  assert status["rollout_workers"] == 1 and status["working"] == [0]
  assert status["pid"] == os.getpid()
  line = elastic.request(str(tmp_path), 3)
  assert "for 3 Ray rollout workers (it had asked for 1)" in line
  watch.poll()
  watch.poll()  # the same request again: nothing more
  assert rollout.asked == [3]
  rollout._members["working"] = [0, 1, 2]
  watch.poll()
  status = json.loads((tmp_path / elastic.STATUS).read_text())
  assert status["working"] == [0, 1, 2] and status["rollout_workers"] == 3
  (tmp_path / elastic.REQUEST).write_text('{"rollout_workers": "many"}')  # by hand: ignored
  watch.poll()
  assert rollout.asked == [3]
  elastic.request(str(tmp_path), 1)
  watch.poll()
  assert rollout.asked == [3, 1]
  # a later process of the same run starts with the count last asked for
  again = _Rollout(3)
  elastic.ScaleWatch(str(tmp_path), again, 3)
  assert again.asked == [1]


def test_a_resume_puts_groups_of_units_gone_since_the_checkpoint_into_a_unit_it_has():
  """Scaled 1 -> 3 -> 1, saved while retired unit 2 still held groups: the resumed process has
  unit 0 only; the index's groups, the queued mini-batches and the snapshot move together."""
  from knitjax.runtime.disaggregated import onto_units
  from knitjax.runtime.learner import RunState
  from knitjax.transfer.admission import MiniBatch
  from knitjax.transfer.group import GroupMeta

  def meta(gid, unit):
    return GroupMeta(
      group_id=gid, cls="arith", gen_version=0, num_samples=2, prompt_tokens=(3, 3),
      response_tokens=(1, 2), reward_mean=0.5, reward_std=0.5, storage_unit=unit,
    )  # fmt: skip

  state = RunState(
    admission={"open": [meta(1, 2).to_dict()], "waiting": [[0, meta(2, 0).to_dict()]]},
    queued=(MiniBatch(0, 0, (meta(3, 2), meta(4, 0))),),
    payloads={"groups": [{"group_id": g, "storage_unit": u} for g, u in ((1, 2), (2, 0))]},
  )
  moved = onto_units(state, [0])
  assert [g["storage_unit"] for g in moved.admission["open"]] == [0]
  assert [g["storage_unit"] for _, g in moved.admission["waiting"]] == [0]
  assert [g.storage_unit for g in moved.queued[0].groups] == [0, 0]
  assert [g["storage_unit"] for g in moved.payloads["groups"]] == [0, 0]
  assert onto_units(state, [0, 2]) == state  # every unit there: nothing moves


@pytest.mark.skip(
  reason="in the suite, later Ray starts of its worker failed (InvalidAuthToken, CI of 12c0def)"
)
def test_a_worker_whose_node_is_gone_is_dropped_and_its_share_generated_again(monkeypatch):
  """Ray counts the node of worker 0 dead (as after a partition): its share goes to worker 1,
  every group id comes back once, the run goes on with one worker; no restart is counted."""
  ray = pytest.importorskip("ray")
  import jax

  from configs import arith_tiny
  from knitjax.config import from_config_dict
  from knitjax.distributed import ray_rollout
  from knitjax.distributed.local_ray import ensure_ray
  from knitjax.distributed.topology import choose
  from knitjax.runtime import builder

  if ray.is_initialized():
    ray.shutdown()
  c = arith_tiny.get_config("quick")
  c.topology.rollout_workers = 2
  config = from_config_dict(c)
  ensure_ray(config.topology.ray_address)
  try:
    prompts = builder.build_prompts(config)
    mesh = builder.build_mesh(config)
    graphdef, params = builder.build_model(config, mesh)
    pool = choose(config).rollout(config, graphdef, mesh, prompts)
    pool.adopt(params, 0)
    ids = list(range(100, 108))
    for prompt, gid in zip(prompts.next({"arith": len(ids)}), ids, strict=True):
      pool.start(prompt, gid)
    rng = jax.random.key(0)
    node = pool._workers[0].node
    monkeypatch.setattr(ray_rollout, "_node_alive", lambda n: n != node)
    os.kill(pool.pids()["rollout"][0], 9)  # before its share reaches it (a share can be quick)
    metas = pool.step(rng)  # a share to each worker; worker 0's call fails
    call = 1
    while pool.inflight:
      metas += pool.step(jax.random.fold_in(rng, call))
      call += 1
      assert call < 10_000
    assert sorted(m.group_id for m in metas) == ids  # each group id exactly once
    assert pool.members()["working"] == [1] and pool.workers == 1
    assert pool.members()["asked"] == 1  # the count asked for drops with the node
    s = pool.stats()
    assert s.actor_restarts == 0 and s.groups_regenerated == 4
    assert {m.storage_unit for m in metas} == {1} and sorted(pool.storage) == [1]
    pool.close()
  finally:
    ray.shutdown()


@pytest.mark.skip(
  reason="in the suite, later Ray starts of its worker failed (InvalidAuthToken, CI of 12c0def)"
)
def test_elastic_bench_quick_scales_1_to_3_to_1_and_loses_nothing(tmp_path):
  pytest.importorskip("ray")
  from configs.bench import elastic as elastic_config
  from lab.bench import elastic as bench

  out = bench.run(elastic_config.get_config("quick"), str(tmp_path))
  assert out["quota_violations"] == 0
  assert out["version_bound_violations"] == 0
  assert out["groups_lost"] == 0 and out["consumed_twice"] == 0
  assert (
    out["groups_offered"] == out["groups_consumed"] + out["groups_rejected"] + out["groups_pending"]
  )
  groups = out["groups_per_worker"]
  assert sorted(groups) == ["0", "1", "2"]
  assert all(groups[w] > 0 for w in ("1", "2"))  # the new workers took groups
  assert out["seconds_to_first_group"] is not None
  assert out["workers_at_end"] == [0]  # back to one
  assert [r["workers"] for r in out["requests"]] == [3, 1]
  assert set(out["phases"]) == {"before", "scaled", "after"}
  assert os.path.exists(tmp_path / "elastic.json") and os.path.exists(tmp_path / "elastic.png")
