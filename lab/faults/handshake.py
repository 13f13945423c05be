"""Part of the fault suite: hostile peers at the trainer's rollout endpoint while a host attaches.

A trial starts a trainer waiting for one rollout host (`knitjax.rollout.remote.RemoteRollout` on
loopback, a throwaway token), sends it one to four hostile peers drawn with hypothesis, and then
(in most trials) a real host (`knitjax.rollout.remote_host.serve` with an idle rollout). Hostile
peers: a silent TCP connection, a wrong token, an empty token, a pickle that would run code, bytes
that are no frame, a frame with a huge length, a hello of the wrong kind or types, a host that dies
after its hello, a peer that authenticates and then says nothing. The trainer's handshake limit
is shortened to `HANDSHAKE_S` so a trial takes seconds.

A trial is counted as

- attached: the real host attached despite the peers (and no code ran);
- refused: no real host came, and the trainer's wait ended in one sentence naming every hostile
  peer's address (``not_named`` too when it missed one);
- tracebacks: the trainer raised anything else;
- code_ran: a pickle's code ran in the trainer (a security failure);
- hangs: the trainer did not return within its wait plus `GRACE_S`.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import tempfile
import threading
import time
from multiprocessing import connection as mpc

import numpy as np
from hypothesis import strategies as st

from lab.faults.bad_inputs import core

TOKEN = b"k" * 32
HANDSHAKE_S = 0.5
WAIT_S = 3.0
GRACE_S = 10.0
COUNTERS = ("trials", "attached", "refused", "tracebacks", "code_ran", "hangs", "not_named")
PEERS = (
  "silent",
  "wrong_token",
  "empty_token",
  "pickle",
  "garbage",
  "huge_length",
  "wrong_kind",
  "wrong_types",
  "dies_after_hello",
  "mute_after_auth",
)


class _RunsCode:
  """Pickles to a call that creates ``marker``: proof of code run by whoever unpickles it."""

  def __init__(self, marker: str):
    self.marker = marker

  def __reduce__(self):
    return (open, (self.marker, "w"))


class _IdleRollout:
  """A host's rollout that never has room: attaching is all a trial needs of it."""

  inflight = 0

  def adopt(self, params, version):
    pass

  def capacity(self):
    return 0

  def start(self, prompt, group_id):
    raise AssertionError("an idle rollout starts nothing")

  def step(self, rng, *, want_room=False):
    return []

  def stats(self):
    from knitjax.rollout.contract import RolloutStats

    return RolloutStats()

  def close(self):
    pass


class _Channel:
  address = "in-memory"

  def stage(self, params, *ids):
    pass


def _peer(kind: str, address: tuple[str, int], marker: str) -> None:
  """Plays one hostile peer against the endpoint at ``address``; errors on its side are expected."""
  from knitjax.rollout import wire

  def authenticated():
    return mpc.Client(address, authkey=TOKEN)

  try:
    if kind == "silent":
      s = socket.create_connection(address)
      time.sleep(HANDSHAKE_S * 3)
      s.close()
    elif kind in ("wrong_token", "empty_token"):
      mpc.Client(address, authkey=b"w" * 32 if kind == "wrong_token" else b"")
    elif kind == "pickle":
      with authenticated() as conn:
        conn.send(_RunsCode(marker))
        time.sleep(0.1)
    elif kind == "garbage":
      with authenticated() as conn:
        conn._send(b"\x00\x00\x00\x05not a frame at all")
        time.sleep(0.1)
    elif kind == "huge_length":
      with authenticated() as conn:
        conn._send(struct.pack("!i", 2**31 - 1) + b"x" * 64)
        time.sleep(0.1)
    elif kind == "wrong_kind":
      with authenticated() as conn:
        conn.send_bytes(wire.encode("report", [], 0, _stats(), 0))
        time.sleep(0.1)
    elif kind == "wrong_types":
      with authenticated() as conn:
        conn.send_bytes(wire.encode("control", 5, "pid"))
        time.sleep(0.1)
    elif kind == "dies_after_hello":
      with authenticated() as conn:
        wire.send(conn, "control", "doomed", 4242)
        conn.poll(WAIT_S)
    elif kind == "mute_after_auth":
      with authenticated() as conn:
        time.sleep(HANDSHAKE_S * 3)
  except (OSError, EOFError, mpc.AuthenticationError):
    pass


def _stats():
  from knitjax.rollout.contract import RolloutStats

  return RolloutStats()


def _host(address: str, out: dict) -> None:
  import jax

  from knitjax.rollout import remote_host
  from knitjax.transfer.storage import InProcessStorageUnit, StorageLimits

  def attach(unit_id, paths):
    unit = InProcessStorageUnit(
      StorageLimits(vocab_size=8, max_seq_len=8, max_bytes=1 << 20), unit_id=unit_id
    )
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    specs = [jax.sharding.PartitionSpec()]
    return remote_host.Attached(_IdleRollout(), unit, mesh, specs, lambda a: lambda i: None)

  try:
    out["host"] = remote_host.serve(address, TOKEN, attach, timeout_s=WAIT_S)
  except Exception as e:  # noqa: BLE001 - recorded: a host refused is part of some trials
    out["host"] = e


def trial(peers: list[str], with_host: bool, marker: str) -> list[str]:
  """One trial; returns the counters it adds to (see the module docstring)."""
  from knitjax.rollout import remote

  out: dict = {}
  listening = threading.Event()

  def trainer():
    try:
      out["rollout"] = remote.RemoteRollout(
        1,
        "127.0.0.1:0",
        TOKEN,
        published={"w": np.zeros(1, np.float32)},
        weights=lambda specs, mesh: _Channel(),
        timeout_s=WAIT_S,
        on_listen=lambda a: (out.__setitem__("address", a), listening.set()),
      )
    except Exception as e:  # noqa: BLE001 - what the trainer raised is being classified
      out["error"] = e

  t = threading.Thread(target=trainer, daemon=True)
  t.start()
  if not listening.wait(10):
    return ["hangs"]
  address = remote.split_address(out["address"])
  threads = [
    threading.Thread(target=_peer, args=(kind, address, marker), daemon=True) for kind in peers
  ]
  for p in threads:
    p.start()
  if with_host:
    time.sleep(0.05)
    threading.Thread(target=_host, args=(out["address"], out), daemon=True).start()
  t.join(WAIT_S + GRACE_S)
  for p in threads:
    p.join(GRACE_S)
  if "rollout" in out:
    out["rollout"].close()
  outcome = []
  if os.path.exists(marker):
    outcome.append("code_ran")
  if t.is_alive():
    return [*outcome, "hangs"]
  if "rollout" in out:
    return [*outcome, "attached"]
  err = out.get("error")
  message = str(err)
  if not isinstance(err, TimeoutError | ValueError) or "\n" in message:
    return [*outcome, "tracebacks"]
  outcome.append("refused")
  # every hostile peer that reached the handshake is named by its address in the final message
  named = len(re.findall(r"127\.0\.0\.1:\d+", message)) - 1  # less the endpoint's own
  if named < len(peers):
    outcome.append("not_named")
  return outcome


def run(*, trials: int = 40, seed: int = 0, log=print) -> dict:
  """``trials`` drawn trials; returns the counters and the trials that were not clean."""
  from knitjax.rollout import remote

  counts = dict.fromkeys(COUNTERS, 0)
  failures = []
  saved = remote._HANDSHAKE_S
  remote._HANDSHAKE_S = HANDSHAKE_S
  try:
    with tempfile.TemporaryDirectory() as scratch:

      def one(draw):
        peers = draw(st.lists(st.sampled_from(PEERS), min_size=1, max_size=4))
        with_host = draw(st.integers(0, 3)) > 0
        marker = os.path.join(scratch, f"ran_{counts['trials']}")
        outcome = trial(peers, with_host, marker)
        counts["trials"] += 1
        for name in outcome:
          counts[name] += 1
        clean = ("attached",) if with_host else ("refused",)
        if tuple(outcome) != clean:
          failures.append({"peers": peers, "with_host": with_host, "outcome": outcome})
        log(f"  handshake {peers} {'+ host ' if with_host else ''}-> {','.join(outcome)}")

      core.generate_case(trials, seed, one)
  finally:
    remote._HANDSHAKE_S = saved
  return {"counts": counts, "failures": failures[:40]}
