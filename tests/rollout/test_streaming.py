"""The streaming rollout with host work overlapping decoding: the next engine call runs while the
host scores and stores the last call's groups."""

import jax

from tests.rollout.test_contract import G, _streaming, parts  # noqa: F401 (fixture)


def test_a_step_reports_the_last_call_while_the_next_one_runs(parts):  # noqa: F811
  source, _, _, params, mesh, _ = parts
  rollout = _streaming(parts)
  engine = rollout.engine
  rollout.adopt(params, 0)
  assert rollout.capacity() == 2  # 2 G slots, nothing running: the room known
  rollout.start(source.next(1)[0], 0)
  rollout.start(source.next(1)[0], 1)
  with jax.set_mesh(mesh):
    assert rollout.step(jax.random.key(0)) == []  # launched, nothing collected yet
    assert engine.in_flight
    # The running call may free slots: one group per prefill lane (2 shards x 1) may queue.
    assert rollout.capacity() == 2
    rollout.start(source.next(1)[0], 2)
    rollout.start(source.next(1)[0], 3)
    assert rollout.capacity() == 0
    rollout.adopt(jax.tree.map(lambda x: x * 1.5, params), 1)  # while the call runs
    metas, call = [], 1
    while rollout.inflight and call < 100:
      metas += rollout.step(jax.random.key(call))
      call += 1
  assert sorted(m.group_id for m in metas) == [0, 1, 2, 3]
  version = {m.group_id: m.gen_version for m in metas}
  # The first two started on version 0; the queued two start decoding after the adoption.
  assert version == {0: 0, 1: 0, 2: 1, 3: 1}
  assert all(len(m.response_tokens) == G for m in metas)
