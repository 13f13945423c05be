"""The rollout contract over rollout hosts (knitjax.rollout.remote), with hosts as threads.

The hosts here serve a scripted rollout (each started group completes after a set number of its
host's steps, writing a synthetic payload into the host's unit), so the protocol is what is
tested: starts go where there is room, capacity stays right while answers are in flight,
``adopt`` reaches a host before the starts sent after it, every group comes back once, storage
calls (and their errors) cross by type, and a wrong token is refused.
"""

import os
import re
import socket
import threading
import time
from multiprocessing import connection as mpc

import jax
import numpy as np
import pytest

from knitjax.rollout import remote, remote_host, wire
from knitjax.rollout.contract import RolloutStats
from knitjax.tasks.prompts import Prompt
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.payload import synthetic_payload
from knitjax.transfer.storage import InProcessStorageUnit, StorageLimits

TOKEN = b"test-token"
G, P, N = 2, 3, 4
LIMITS = StorageLimits(vocab_size=32, max_seq_len=P + N, max_bytes=1 << 20)


class ScriptedRollout:
  """Holds ``slots`` groups; a group completes on the ``steps``-th host step after its start."""

  def __init__(self, unit, *, slots=3, steps=2):
    self.unit, self.slots, self.steps = unit, slots, steps
    self.version, self.live, self.log = None, {}, []
    self._stats = RolloutStats()

  @property
  def inflight(self):
    return len(self.live)

  def adopt(self, params, version):
    self.version = version
    self.log.append(("adopt", version, float(params["w"][0])))

  def capacity(self):
    return self.slots - len(self.live)

  def start(self, prompt, group_id):
    assert len(self.live) < self.slots, "started past capacity"
    self.live[group_id] = [prompt, 0, self.version]
    self.log.append(("start", group_id, self.version))

  def step(self, rng, *, want_room=False):
    done = []
    for gid, entry in list(self.live.items()):
      entry[1] += 1
      if entry[1] >= self.steps:
        payload = synthetic_payload(
          np.random.default_rng(gid), group_size=G, prompt_len=P, response_len=N, vocab_size=32
        )
        self.unit.put(gid, payload)
        lens = tuple(int(x) for x in payload["response_lengths"])
        done.append(
          GroupMeta(
            group_id=gid,
            cls=entry[0].cls,
            gen_version=entry[2],
            num_samples=G,
            prompt_tokens=(P,) * G,
            response_tokens=lens,
            storage_unit=self.unit.unit_id,
          )
        )
        del self.live[gid]
    self._stats.decode_iterations += 1
    self._stats.live_samples = G * len(self.live)
    return done

  def stats(self):
    return self._stats

  def close(self):
    pass


class Channel:
  """Weights through a dict: ``stage`` keeps the params under each id, hosts read them."""

  def __init__(self):
    self.staged, self.address = {}, "in-memory"

  def stage(self, params, *ids):
    for i in ids:
      self.staged[i] = params


def _prompt(i):
  return Prompt(prompt_id=i, cls="a", text=str(i), tokens=np.arange(P, dtype=np.int32), answer="")


def _start_hosts(n, channel, rollouts, results, token=TOKEN):
  def attach(unit_id, paths):
    assert [p[0] for p in paths] == [("w",)]
    unit = InProcessStorageUnit(LIMITS, unit_id=unit_id)
    rollouts[unit_id] = ScriptedRollout(unit)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    specs = [jax.sharding.PartitionSpec()]
    return remote_host.Attached(rollouts[unit_id], unit, mesh, specs, lambda a: channel.staged.get)

  def host(k):
    try:
      results[k] = remote_host.serve(ADDRESS[0], token, attach, timeout_s=30)
    except Exception as e:  # noqa: BLE001 - surfaced by the test
      results[k] = e

  threads = [threading.Thread(target=host, args=(k,), daemon=True) for k in range(n)]
  for t in threads:
    t.start()
  return threads


ADDRESS = [""]


def _wait_for_address():
  for _ in range(3000):
    if ADDRESS[0]:
      return
    time.sleep(0.01)
  raise AssertionError("the trainer side never listened")


def _rollout(n, channel, *, weights=None, **kw):
  def on_listen(address):
    ADDRESS[0] = address

  published = {"w": np.zeros(1, np.float32)}
  return remote.RemoteRollout(
    n,
    "127.0.0.1:0",
    TOKEN,
    published=published,
    weights=weights or (lambda s, m: channel),
    on_listen=on_listen,
    **kw,
  )


def _run(n_hosts):
  channel, rollouts, results = Channel(), {}, {}
  holder = {}
  t = threading.Thread(target=lambda: holder.setdefault("r", _rollout(n_hosts, channel)))
  t.start()
  _wait_for_address()
  threads = _start_hosts(n_hosts, channel, rollouts, results)
  t.join(30)
  return holder["r"], channel, rollouts, results, threads


def test_groups_come_back_once_with_the_version_they_started_on():
  ADDRESS[0] = ""
  r, channel, rollouts, results, threads = _run(2)
  try:
    assert sorted(r.storage) == [0, 1]
    assert r.capacity() == 6 and r.version is None
    with pytest.raises(RuntimeError, match="no policy"):
      r.start(_prompt(0), 0)
    r.adopt({"w": np.full(1, 1.0, np.float32)}, 1)
    started, got, gid = [], [], 0
    key = jax.random.key(0)
    for call in range(40):
      if gid == 6 and r.version == 1:  # the first six start on version 1, the rest on 2
        r.adopt({"w": np.full(1, 2.0, np.float32)}, 2)
      while r.capacity() and gid < 14:
        r.start(_prompt(gid), gid)
        started.append(gid)
        gid += 1
      got += r.step(jax.random.fold_in(key, call))
      if len(got) == 14:
        break
    assert sorted(m.group_id for m in got) == list(range(14))
    assert r.inflight == 0
    # each host saw its adopts before the starts sent after them: versions follow send order
    for ro in rollouts.values():
      versions = [e[2] for e in ro.log if e[0] == "start"]
      assert versions == sorted(versions)
      assert [e[1:] for e in ro.log if e[0] == "adopt"] == [(1, 1.0), (2, 2.0)]
    by_gid = {m.group_id: m for m in got}
    assert {by_gid[g].gen_version for g in range(6)} == {1}
    assert {by_gid[g].gen_version for g in range(6, 14)} == {2}
    # both hosts worked; payloads stay in each host's unit and are read through the trainer's view
    units = {m.storage_unit for m in got}
    assert units == {0, 1}
    m = got[0]
    payload = r.storage[m.storage_unit].get([m.group_id])[0]
    assert payload.response_lengths.tolist() == list(m.response_tokens)
    stats = r.stats()
    assert stats.tokens == sum(sum(m.response_tokens) for m in got)
    assert stats.decode_iterations > 0
  finally:
    r.close()
  for t in threads:
    t.join(10)
  served = {res["unit_id"]: res for res in results.values()}  # thread order != unit order
  assert {u: served[u]["groups"] for u in (0, 1)} == {
    u: sum(m.storage_unit == u for m in got) for u in (0, 1)
  }
  assert [served[u]["versions"] for u in (0, 1)] == [2, 2]


def test_a_host_whose_room_fell_below_its_unread_starts_has_no_room_not_less():
  ADDRESS[0] = ""
  r, channel, rollouts, results, threads = _run(2)
  try:
    r._hosts[0].capacity, r._hosts[1].capacity = -2, 1  # host 0 reported less than it holds
    assert r.capacity() == 1
    r.adopt({"w": np.full(1, 1.0, np.float32)}, 1)
    r.start(_prompt(0), 0)  # goes to the host with room
    assert (r._hosts[0].starts_sent, r._hosts[1].starts_sent) == (0, 1)
    assert r.capacity() == 0
  finally:
    r.close()
  for t in threads:
    t.join(10)


def test_storage_calls_and_their_errors_cross_by_type():
  ADDRESS[0] = ""
  r, channel, rollouts, results, threads = _run(1)
  try:
    unit = r.storage[0]
    payload = synthetic_payload(
      np.random.default_rng(0), group_size=G, prompt_len=P, response_len=N, vocab_size=32
    )
    assert unit.put(7, payload) > 0
    assert unit.get([7])[0].prompt_tokens.shape == (G, P)
    with pytest.raises(KeyError, match=r"groups \[8\] are not held by storage unit 0"):
      unit.get([8])
    with pytest.raises(remote.HostError, match="PayloadError"):
      unit.put(7, payload)  # a duplicate id is refused by the host's unit
    unit.release([7, 9])
    stats = unit.stats()
    assert stats["groups"] == 0 and stats["release_misses"] == 1
  finally:
    r.close()
  for t in threads:
    t.join(10)


def _trainer_waiting(holder, timeout_s, **kw):
  """A trainer waiting ``timeout_s`` for one host in a thread; its TimeoutError into ``holder``."""
  ADDRESS[0] = ""

  def trainer():
    try:
      holder["r"] = _rollout(1, Channel(), timeout_s=timeout_s, **kw)
    except TimeoutError as e:
      holder["error"] = e

  t = threading.Thread(target=trainer)
  t.start()
  _wait_for_address()
  return t, remote.split_address(ADDRESS[0])


def _authenticated(address):
  return mpc.Client(address, authkey=TOKEN)


def test_a_wrong_token_is_refused_in_one_sentence_on_both_sides():
  holder = {}
  t, address = _trainer_waiting(holder, 1)
  with pytest.raises(ValueError, match=r"^the trainer at 127\.0\.0\.1:\d+ refused this rollout "):
    remote_host.serve(ADDRESS[0], b"wrong", lambda *a: None, timeout_s=5)
  t.join(10)
  msg = str(holder["error"])
  assert "0 of 1 rollout hosts attached" in msg and "--role=rollout" in msg
  assert re.search(r"the peer at 127\.0\.0\.1:\d+ presented a wrong token", msg), msg


def test_a_pickle_from_an_authenticated_peer_is_not_run(tmp_path):
  marker = tmp_path / "ran"

  class RunsCode:
    def __reduce__(self):
      return (os.system, (f"touch {marker}",))

  holder = {}
  t, address = _trainer_waiting(holder, 1)
  with _authenticated(address) as conn:
    conn.send(RunsCode())  # pickled: the trainer must not unpickle it
    t.join(10)
  assert not marker.exists()
  msg = str(holder["error"])
  assert re.search(r"the peer at 127\.0\.0\.1:\d+ sent a message that does not decode", msg), msg


def test_malformed_hellos_are_refused_and_named():
  holder = {}
  t, address = _trainer_waiting(holder, 1)
  for hello in (
    ["control"],  # (pickled) not a message
    wire.encode("control", 5, "pid"),  # wrong types
    wire.encode("storage", 3),  # a unit no attaching host holds
    wire.encode("report", [], 0, RolloutStats(), 0),  # not a hello
  ):
    with _authenticated(address) as conn:
      conn.send(hello) if isinstance(hello, list) else conn.send_bytes(hello)
      time.sleep(0.05)
  t.join(10)
  msg = str(holder["error"])
  assert msg.count("the peer at 127.0.0.1:") == 4, msg
  assert "'control' message that does not decode (expected str, got 5)" in msg
  assert "storage connection for unit 3, which no attaching host holds" in msg
  assert "sent a 'report' message; expected one of ['control', 'storage']" in msg
  assert "\n" not in msg


def test_a_host_killed_while_attaching_is_named_and_its_slot_taken_by_the_next(caplog):
  channel, rollouts, results, holder = Channel(), {}, {}, {}
  t, address = _trainer_waiting(holder, 20, weights=None)
  with _authenticated(address) as conn:  # attaches as host 0, then dies before it is ready
    wire.send(conn, "control", "doomed", 4242)
    assert conn.poll(10), "the trainer never answered the hello"
    assert wire.recv(conn, ("welcome",), "trainer")[1] == 0
  threads = _start_hosts(1, channel, rollouts, results)
  t.join(20)
  assert "r" in holder, holder
  assert sorted(holder["r"].storage) == [0]
  assert re.search(
    r"rollout host 0 \(doomed, pid 4242, 127\.0\.0\.1:\d+\) closed the connection while "
    "attaching",
    caplog.text,
  ), caplog.text
  holder["r"].close()
  for h in threads:
    h.join(10)


def test_split_address():
  assert remote.split_address("10.0.0.2:7000") == ("10.0.0.2", 7000)
  assert remote.split_address("localhost:0") == ("localhost", 0)
  with pytest.raises(ValueError, match="not host:port"):
    remote.split_address("localhost")


def test_a_host_that_goes_away_ends_the_call_in_one_sentence():
  ADDRESS[0] = ""
  r, channel, rollouts, results, threads = _run(1)
  try:
    r.adopt({"w": np.full(1, 1.0, np.float32)}, 1)
    r.start(_prompt(0), 0)
    # the host's end of both connections goes away (as when its process is killed)
    for conn in (r._hosts[0].control, r._hosts[0].unit._conn):
      socket.socket(fileno=os.dup(conn.fileno())).shutdown(socket.SHUT_RDWR)
    with pytest.raises(remote.HostError, match=r"rollout host 0 .* went away .* resume from"):
      for call in range(10):
        r.step(jax.random.key(call))
    with pytest.raises(remote.HostError, match="its storage connection is gone"):
      r.storage[0].get([0])
  finally:
    r.close()
  for t in threads:
    t.join(10)


def test_silent_connections_hold_neither_the_trainer_nor_each_other():
  # the handshake limit stays at its 10 s: three silent peers must not delay the real host
  ADDRESS[0] = ""
  channel, rollouts, results, holder = Channel(), {}, {}, {}
  t = threading.Thread(target=lambda: holder.setdefault("r", _rollout(1, channel, timeout_s=5)))
  t.start()
  _wait_for_address()
  silent = [socket.create_connection(remote.split_address(ADDRESS[0])) for _ in range(3)]
  time.sleep(0.1)
  t0 = time.monotonic()
  threads = _start_hosts(1, channel, rollouts, results)
  t.join(20)
  for s in silent:
    s.close()
  assert "r" in holder, "the trainer never got past the silent connections"
  assert time.monotonic() - t0 < 4
  assert sorted(holder["r"].storage) == [0]
  holder["r"].close()
  for h in threads:
    h.join(10)


def test_a_silent_peer_cut_off_is_named_in_the_final_message(monkeypatch):
  monkeypatch.setattr(remote, "_HANDSHAKE_S", 0.2)
  holder = {}
  t, address = _trainer_waiting(holder, 1)
  silent = socket.create_connection(address)
  t.join(10)
  silent.close()
  assert re.search(r"the peer at 127\.0\.0\.1:\d+ said nothing within 0\.2 s", str(holder["error"]))


def test_a_port_in_use_is_one_sentence_at_once():
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    address = f"127.0.0.1:{taken.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(
      ValueError, match=rf"cannot listen on '{address}' \(Address already in use\)"
    ):
      remote.RemoteRollout(1, address, TOKEN, published={}, weights=None, timeout_s=30)
    assert time.monotonic() - t0 < 1


def test_connections_notice_a_lost_peer_within_dead_peer_s():
  """Keepalive and TCP_USER_TIMEOUT bound how long a partitioned peer goes unnoticed."""
  listener = mpc.Listener(("127.0.0.1", 0))
  client = mpc.Client(listener.address)
  server = listener.accept()
  try:
    for conn in (remote.tuned(client), remote.tuned(server)):
      with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        opt = sock.getsockopt
        assert opt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert opt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        idle, intvl, cnt = (
          opt(socket.IPPROTO_TCP, o)
          for o in (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT)
        )
        assert idle + intvl * cnt <= remote.DEAD_PEER_S
        assert opt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == remote.DEAD_PEER_S * 1000
  finally:
    client.close()
    server.close()
    listener.close()
