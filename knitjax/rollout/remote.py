"""The rollout contract over rollout host processes, driven call for call over sockets.

A disaggregated trainer with ``runtime.rollout_hosts`` does not generate in process: separate
rollout host processes (``python -m knitjax.main --role=rollout``, each with its own
accelerators and its own JAX runtime, not part of the trainer's ``jax.distributed`` cluster)
connect to it. :class:`RemoteRollout` is the trainer's view of them, one rollout behind the
contract of `knitjax.rollout.contract`, so the trainer's rollout thread, admission index and
depth bound drive it as they drive an in-process rollout: ``start`` goes to the host with the
most room, ``adopt`` offers the version for the hosts to pull, ``step`` returns the groups the
hosts reported. A host does not wait to be asked: while it holds groups it steps its own
rollout (continuous engine, batched sampler or multi-turn) and reports after every step (the
groups completed, its room, its counters), reading the trainer's messages (starts, adopts)
between steps in the order they were sent, so generation never waits for a round trip. Only
``GroupMeta`` crosses to the trainer; payloads stay in each host's storage unit, which the
trainer's consumers read through :class:`RemoteStorageUnit` (a second connection, served by
its own thread on the host, so fetches never wait behind generation).
`knitjax.rollout.remote_host` is the host's side.

Each host keeps two connections to the trainer (``multiprocessing.connection``, authenticated
with the run's token by an HMAC challenge before anything is unpickled): *control* (contract
calls, answered in order) and *storage* (unit calls). Weights do not use them: the trainer
offers each version through a :class:`WeightChannel` (in a run, ``jax.experimental.transfer``
from device to device, `knitjax.runtime.weight_transfer`) and tells each host which offer to
pull. Hosts are not restarted: one that disconnects ends the run with one sentence (resume
restores the held payloads into the new hosts' units).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing import connection as mpc
from typing import Protocol

import jax
import numpy as np

from knitjax.rollout.contract import RolloutStats
from knitjax.tasks.prompts import Prompt
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.storage import StorageFull, StorageUnit

_WAIT_S = 0.5  # a step returns after this long even if no host answered (the caller polls)
_HANDSHAKE_S = 10.0  # a connecting peer must authenticate and say hello within this long

# Exceptions a call may raise on the host that the trainer raises again by type (the storage
# contract's own; anything else arrives as a RuntimeError naming the host).
_ERRORS = {"KeyError": KeyError, "StorageFull": StorageFull, "ValueError": ValueError}


class HostError(RuntimeError):
  """A rollout host failed a call or went away."""


_RESUME = (
  "the run stops here; start the trainer and its rollout hosts again to resume from the last "
  "checkpoint."
)


class WeightChannel(Protocol):
  """The trainer's side of weight transfer: offers a version for pulls by id."""

  @property
  def address(self) -> str: ...

  def offer(self, params, *offer_ids: int) -> None:
    """Stages ``params`` once and offers them under each id, one pull per id."""


def split_address(address: str) -> tuple[str, int]:
  """``"host:port"`` -> ``(host, port)`` (IPv4 addresses or host names)."""
  host, sep, port = address.rpartition(":")
  if not sep or not port.isdigit():
    raise ValueError(f"address {address!r} is not host:port.")
  return host.strip("[]"), int(port)


def _cut(conn: mpc.Connection) -> None:
  """Shuts ``conn``'s socket down, waking a read blocked on it (the handshake's watchdog)."""
  with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as sock:
    sock.shutdown(socket.SHUT_RDWR)


def no_delay(conn: mpc.Connection) -> mpc.Connection:
  """Turns off Nagle's algorithm on ``conn``'s socket: the protocol sends small messages back to
  back (starts, answers), which Nagle plus delayed ACKs would hold up to ~40 ms each."""
  with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # the same socket, a second fd
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  return conn


def reply(conn: mpc.Connection, fn: Callable[[], object]) -> None:
  try:
    out = ("ok", fn())
  except Exception as e:  # answered, not raised: the host keeps serving
    out = ("error", type(e).__name__, str(e))
  conn.send(out)


def result(reply, who: str):
  if reply[0] == "ok":
    return reply[1]
  _, kind, msg = reply
  raise _ERRORS.get(kind, HostError)(f"{who}: {kind}: {msg}" if kind not in _ERRORS else msg)


class RemoteStorageUnit(StorageUnit):
  """A host's storage unit, called over its storage connection (one call at a time)."""

  def __init__(self, conn: mpc.Connection, unit_id: int, who: str):
    self.unit_id, self._conn, self._who = unit_id, conn, who
    self._lock = threading.Lock()

  def _call(self, *msg):
    with self._lock:
      try:
        self._conn.send(msg)
        return result(self._conn.recv(), self._who)
      except (EOFError, OSError) as e:
        raise HostError(f"{self._who} closed its storage connection ({e!r}); {_RESUME}") from e

  def put(self, group_id, payload, images=()) -> int:
    return self._call("put", group_id, payload, list(images))

  def get(self, group_ids):
    return self._call("get", list(group_ids))

  def get_images(self, hashes):
    return self._call("get_images", list(hashes))

  def release(self, group_ids) -> None:
    self._call("release", list(group_ids))

  def stats(self) -> dict:
    return self._call("stats")

  def close(self) -> None:
    self._conn.close()


@dataclasses.dataclass
class _Host:
  """The trainer's record of one connected host."""

  index: int
  who: str
  control: mpc.Connection
  unit: RemoteStorageUnit
  capacity: int = 0
  inflight: int = 0
  starts_sent: int = 0
  stats: RolloutStats = dataclasses.field(default_factory=RolloutStats)


def leaf_paths(tree) -> list[tuple[tuple, object]]:
  """``(path, leaf)`` of every leaf of a pytree, the path as plain keys (dict keys, indices)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path), x) for path, x in flat]


def published_paths(params) -> list[tuple[tuple, tuple[int, ...], str]]:
  """``(path, shape, dtype)`` of every leaf of a pure-dict pytree, in flatten order."""
  return [(path, tuple(x.shape), str(x.dtype)) for path, x in leaf_paths(params)]


class RemoteRollout:
  """Rollout hosts used as one rollout (see the module docstring).

  Listens on ``address`` and waits (up to ``timeout_s``) until ``hosts`` hosts have attached;
  host ``i`` writes into storage unit ``i``.

  Args:
    hosts: how many rollout hosts to wait for.
    address: ``host:port`` to listen on (port 0: a free one; read ``address`` after).
    authkey: the run's token; hosts must present the same.
    published: a pure-dict pytree shaped like the params ``adopt`` receives (names the leaves
      the hosts pull, in order).
    weights: builds the weight channel once the first host has said how it lays out the
      params: ``weights(specs, mesh_shape)`` with one PartitionSpec per published leaf.
    timeout_s: how long to wait for the hosts.
    on_listen: called with the bound address before waiting (the runtime writes it down).
  """

  def __init__(
    self,
    hosts: int,
    address: str,
    authkey: bytes,
    *,
    published,
    weights: Callable[[list, dict], WeightChannel],
    timeout_s: float = 600.0,
    on_listen: Callable[[str], None] | None = None,
  ):
    if hosts < 1:
      raise ValueError(f"a remote rollout needs at least one host, got {hosts}.")
    self._paths = published_paths(published)
    self._make_weights, self._weights = weights, None
    self._layout: tuple | None = None
    host, port = split_address(address)
    # The listener only binds; `_accept` authenticates (with a bounded handshake).
    self._listener = mpc.Listener((host, port), family="AF_INET")
    self._authkey = authkey
    bound = self._listener.address
    self.address = f"{bound[0]}:{bound[1]}"
    self._hosts: list[_Host] = []
    self._version: int | None = None
    self._tokens = 0
    self._seeded, self._want_room = False, False
    if on_listen is not None:
      on_listen(self.address)
    try:
      self._attach(hosts, timeout_s)
    except BaseException:
      self.close()
      raise
    self._listener.close()  # every host is in: no port stays open for the rest of the run

  # ---- attaching hosts ----------------------------------------------------------------------

  def _accept(self, deadline: float) -> tuple[mpc.Connection, dict]:
    """The next authenticated connection and its hello. The handshake is the one
    ``multiprocessing.connection.Listener.accept`` runs, bounded by `_HANDSHAKE_S`: a peer that
    connects and says nothing (a port scanner) is cut off instead of holding the trainer."""
    sock = self._listener._listener._socket  # the listening socket: bound the accept's wait
    while True:
      left = deadline - time.monotonic()
      if left <= 0:
        raise TimeoutError
      sock.settimeout(left)
      raw, peer = sock.accept()
      raw.setblocking(True)
      conn = mpc.Connection(raw.detach())
      watchdog = threading.Timer(_HANDSHAKE_S, _cut, args=(conn,))
      watchdog.start()
      try:
        mpc.deliver_challenge(conn, self._authkey)
        mpc.answer_challenge(conn, self._authkey)
        hello = conn.recv()
      except (mpc.AuthenticationError, EOFError, OSError) as e:
        logging.warning("a connection from %s to the rollout endpoint was refused (%r).", peer, e)
        conn.close()
        continue
      finally:
        watchdog.cancel()
      return no_delay(conn), hello

  def _attach(self, hosts: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending: dict[int, tuple[mpc.Connection, str]] = {}  # unit id -> control conn awaiting storage
    try:
      while len(self._hosts) < hosts:
        conn, hello = self._accept(deadline)
        if hello.get("role") == "control":
          i = len(pending) + len(self._hosts)
          if i >= hosts:
            conn.send(("error", "ValueError", f"this run takes {hosts} rollout hosts."))
            conn.close()
            continue
          who = f"rollout host {i} ({hello['hostname']}, pid {hello['pid']})"
          conn.send(("ok", {"unit_id": i, "paths": self._paths}))
          ready = result(conn.recv(), who)  # the host has built its rollout: its layout
          self._ensure_weights(ready["specs"], ready["mesh_shape"], who)
          conn.send(("ok", {"weights": self._weights.address}))
          pending[i] = (conn, who)
          logging.info("%s attached (%d devices).", who, ready["devices"])
        elif hello.get("role") == "storage" and hello.get("unit_id") in pending:
          ctl, who = pending.pop(hello["unit_id"])
          unit = RemoteStorageUnit(conn, hello["unit_id"], who)
          ctl.send(("ok", None))  # both connections are up: the host starts serving
          capacity = result(ctl.recv(), who)["capacity"]
          self._hosts.append(_Host(hello["unit_id"], who, ctl, unit, capacity=capacity))
          self._hosts.sort(key=lambda h: h.index)
        else:
          conn.close()
    except TimeoutError:
      raise TimeoutError(
        f"{len(self._hosts)} of {hosts} rollout hosts attached to {self.address} within "
        f"{timeout_s:.0f} s; start them with `python -m knitjax.main --role=rollout` and the "
        "same --config and --workdir (config.runtime.rollout_hosts)."
      ) from None

  def _ensure_weights(self, specs: list, mesh_shape: dict, who: str) -> None:
    layout = (tuple(specs), tuple(sorted(mesh_shape.items())))
    if self._layout is None:
      self._layout = layout
      self._weights = self._make_weights(list(specs), dict(mesh_shape))
    elif layout != self._layout:
      raise ValueError(
        f"{who} lays out the params on mesh {mesh_shape} unlike the first host "
        f"({dict(self._layout[1])}); give every rollout host the same number of devices."
      )

  # ---- the contract -------------------------------------------------------------------------

  @property
  def storage(self) -> Mapping[int, StorageUnit]:
    return {h.index: h.unit for h in self._hosts}

  @property
  def version(self) -> int | None:
    return self._version

  @property
  def inflight(self) -> int:
    return sum(h.inflight for h in self._hosts)

  def _send(self, h: _Host, kind: str, *args) -> None:
    try:
      h.control.send((kind, *args))
    except OSError as e:
      raise HostError(f"{h.who} went away ({e!r}); {_RESUME}") from e

  def adopt(self, params, version: int) -> None:
    if version == self._version:
      return
    n = len(self._hosts)
    ids = [version * n + h.index for h in self._hosts]
    self._weights.offer(params, *ids)
    for h, offer_id in zip(self._hosts, ids, strict=True):
      self._send(h, "adopt", offer_id, version)
    self._version = version

  def capacity(self) -> int:
    return sum(h.capacity for h in self._hosts)

  def start(self, prompt: Prompt, group_id: int) -> None:
    if self._version is None:
      raise RuntimeError("the rollout has no policy: call adopt(params, version) first.")
    h = max(self._hosts, key=lambda h: (h.capacity, -h.inflight))
    if h.capacity <= 0:
      raise RuntimeError("no rollout host has room for another group (check capacity()).")
    self._send(h, "start", prompt, group_id)
    h.capacity -= 1
    h.inflight += 1
    h.starts_sent += 1

  def _receive(self, h: _Host) -> list[GroupMeta]:
    """One report of host ``h``: the groups it completed since the last, its room and counters."""
    try:
      report = result(h.control.recv(), h.who)
    except (EOFError, OSError) as e:
      raise HostError(f"{h.who} went away ({e!r}); {_RESUME}") from e
    # Starts the host had not read yet when it reported are not in its capacity.
    h.capacity = report["capacity"] - (h.starts_sent - report["starts_seen"])
    h.stats = report["stats"]
    h.inflight -= len(report["metas"])
    return report["metas"]

  def step(self, rng: jax.Array, *, want_room: bool = False) -> list[GroupMeta]:
    """The groups the hosts reported since the last call, waiting up to 0.5 s for a report.

    Hosts generate on their own between calls (they step while they hold groups); this call
    passes on the caller's ``want_room`` and, the first time, the hosts' base keys.
    """
    if not self._seeded:
      for h in self._hosts:
        self._send(h, "seed", np.asarray(jax.random.key_data(jax.random.fold_in(rng, h.index))))
      self._seeded = True
    if want_room != self._want_room:
      for h in self._hosts:
        self._send(h, "room", want_room)
      self._want_room = want_room
    conns = [h.control for h in self._hosts]
    if not mpc.wait(conns, timeout=0):
      mpc.wait(conns, timeout=_WAIT_S)
    metas: list[GroupMeta] = []
    for h in self._hosts:
      while h.control.poll():
        metas += self._receive(h)
    self._tokens += sum(sum(m.response_tokens) for m in metas)
    return sorted(metas, key=lambda m: m.group_id)

  def stats(self) -> RolloutStats:
    out = RolloutStats(shards=0)
    for h in self._hosts:
      for f in dataclasses.fields(RolloutStats):
        setattr(out, f.name, getattr(out, f.name) + getattr(h.stats, f.name))
    out.tokens = self._tokens
    return out

  def close(self) -> None:
    for h in self._hosts:
      with contextlib.suppress(OSError):
        h.control.send(("close",))
      h.control.close()
      h.unit.close()
    self._hosts = []
    self._listener.close()
