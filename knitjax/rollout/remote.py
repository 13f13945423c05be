"""The rollout contract over rollout host processes, driven call for call over sockets.

A disaggregated trainer with ``topology.rollout_hosts`` does not generate in process: separate
rollout host processes (``python -m knitjax.main --role=rollout``, each with its own
accelerators and its own JAX runtime, not part of the trainer's ``jax.distributed`` cluster)
connect to it. :class:`RemoteRollout` is the trainer's view of them, one rollout behind the
contract of `knitjax.rollout.contract`, so the trainer's rollout thread, admission index and
depth bound drive it as they drive an in-process rollout: ``start`` goes to the host with the
most room, ``adopt`` stages the version for the hosts to pull, ``step`` returns the groups the
hosts reported. A host does not wait to be asked: while it holds groups it steps its own
rollout (continuous engine, batched sampler or multi-turn) and reports after every step (the
groups completed, its room, its counters), reading the trainer's messages (starts, adopts)
between steps in the order they were sent, so generation never waits for a round trip. Only
``GroupMeta`` crosses to the trainer; payloads stay in each host's storage unit, which the
trainer's consumers read through :class:`RemoteStorageUnit` (a second connection, served by
its own thread on the host, so fetches never wait behind generation).
`knitjax.rollout.remote_host` is the host's side.

Each host keeps two connections to the trainer (``multiprocessing.connection``, authenticated
with the run's token by an HMAC challenge in both directions): *control* (contract calls,
answered in order) and *storage* (unit calls). Nothing on them is pickled: messages are data in
the format of `knitjax.rollout.wire`, decoded by the types each kind expects. Connections are
accepted while hosts attach, each authenticated in its own thread within `_HANDSHAKE_S`, so a
silent, slow or refused peer delays no other. Weights do not use them: the trainer
stages each version in a :class:`WeightChannel` (in a run, ``jax.experimental.transfer``
from device to device, `knitjax.runtime.weight_transfer`) and tells each host which pull id to
pull. Hosts are not restarted: one that disconnects ends the run with one sentence (resume
restores the held payloads into the new hosts' units).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing import connection as mpc
from typing import Protocol

import jax
import numpy as np

from knitjax.rollout import wire
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


class _Dropped(Exception):
  """An attaching host went away or sent something else than the handshake expects."""


def _quietly(send: Callable, conn: mpc.Connection, *args) -> None:
  """``send(conn, *args)`` for an attaching host: a host that went away is `_Dropped`."""
  try:
    send(conn, *args)
  except OSError as e:
    raise _Dropped(f"the connection to an attaching host broke ({e!r})") from None


def _listen(host: str, port: int) -> socket.socket:
  """A TCP socket listening on ``(host, port)``, as `multiprocessing.connection.Listener` opens
  one (address reuse, a backlog of 64)."""
  sock = socket.socket(socket.AF_INET)
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted trainer rebinds
    sock.bind((host, port))
    sock.listen(64)
  except BaseException:
    sock.close()
    raise
  return sock


def _listing(events: list[str]) -> str:
  """``"; refused or lost: a, b"`` for the final wait message (the first 5), or ``""``."""
  if not events:
    return ""
  more = f" and {len(events) - 5} more" if len(events) > 5 else ""
  return f" (refused or lost: {', '.join(events[:5])}{more})"


_RESUME = (
  "the run stops here; start the trainer and its rollout hosts again to resume from the last "
  "checkpoint."
)


class WeightChannel(Protocol):
  """The trainer's side of weight transfer: stages a version for pulls by id."""

  @property
  def address(self) -> str: ...

  def stage(self, params, *pull_ids: int) -> None:
    """Stages ``params`` once under each pull id, one pull per id."""


def split_address(address: str) -> tuple[str, int]:
  """``"host:port"`` -> ``(host, port)`` (IPv4 addresses or host names)."""
  host, sep, port = address.rpartition(":")
  if not sep or not port.isdigit():
    raise ValueError(f"address {address!r} is not host:port.")
  return host.strip("[]"), int(port)


def _cut(conn: mpc.Connection, cut: threading.Event) -> None:
  """Shuts ``conn``'s socket down, waking a read blocked on it (the handshake's watchdog). Sets
  ``cut`` first, so the woken reader knows the watchdog did it (the timer thread itself may still
  be running when the read returns)."""
  cut.set()
  with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as sock:
    sock.shutdown(socket.SHUT_RDWR)


DEAD_PEER_S = 40  # a peer unreachable this long fails the connection (see `tuned`)


def tuned(conn: mpc.Connection) -> mpc.Connection:
  """Sets the TCP options of a trainer-host connection on ``conn``'s socket:

  - Nagle's algorithm off: the protocol sends small messages back to back (starts, answers),
    which Nagle plus delayed ACKs would hold up to ~40 ms each;
  - a lost peer is noticed: keepalive probes after 10 s of silence, every 5 s, the connection
    failing after 6 unanswered ones, and ``TCP_USER_TIMEOUT``: data unacknowledged for
    ``DEAD_PEER_S`` fails it too. A partitioned host or trainer then ends the run with one
    sentence within about ``DEAD_PEER_S`` instead of a read that waits forever; a link that is
    down for less than that only delays the run.
  """
  with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # the same socket, a second fd
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 6)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, DEAD_PEER_S * 1000)
  return conn


def reply(conn: mpc.Connection, fn: Callable[[], object]) -> None:
  """Answers a call with ``("ok", fn())``, or ``("error", type, message)`` when it raised."""
  try:
    frame = wire.encode("ok", fn())
  except Exception as e:  # answered, not raised: the host keeps serving
    frame = wire.encode("error", type(e).__name__, str(e))
  conn.send_bytes(frame)


def raise_error(kind: str, msg: str, who: str):
  """Raises a failure ``who`` reported: by type for the storage contract's own, else HostError."""
  raise _ERRORS.get(kind, HostError)(f"{who}: {kind}: {msg}" if kind not in _ERRORS else msg)


def result(conn: mpc.Connection, kind: str, who: str):
  """The next message on ``conn``, which must be ``kind`` (its one argument, or its arguments) or
  an error that ``who`` reports (raised, see :func:`raise_error`)."""
  got, *args = wire.recv(conn, (kind, "error"), who)
  if got == "error":
    raise_error(*args, who)
  return args[0] if len(args) == 1 else args


class RemoteStorageUnit(StorageUnit):
  """A host's storage unit, called over its storage connection (one call at a time)."""

  def __init__(self, conn: mpc.Connection, unit_id: int, who: str):
    self.unit_id, self._conn, self._who = unit_id, conn, who
    self._lock = threading.Lock()

  def _call(self, kind: str, *args):
    expect = {"ok": (wire.REPLIES[kind],), "error": wire.MESSAGES["error"]}
    with self._lock:
      try:
        wire.send(self._conn, kind, *args)
        got, *out = wire.recv(self._conn, expect, self._who)
      except (EOFError, OSError) as e:
        raise HostError(f"{self._who}: its storage connection is gone ({e!r}); {_RESUME}") from e
      except wire.WireError as e:
        raise HostError(str(e)) from None
    if got == "error":
      raise_error(*out, self._who)
    return out[0]

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
    # A plain listening socket, set up as `multiprocessing.connection.Listener` sets up its own,
    # so `_accept_loop` can accept with a timeout; `_handshake` authenticates each connection.
    try:
      self._listener = _listen(host, port)
    except (OSError, OverflowError) as e:  # in use, not this machine's, unresolvable, > 65535
      raise ValueError(
        f"the rollout endpoint cannot listen on {address!r} ({getattr(e, 'strerror', None) or e}); "
        "give config.topology.rollout_listen an address of this machine and a free port (0: any)."
      ) from None
    self._authkey = authkey
    bound = self._listener.getsockname()
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

  def _accept_loop(self, inbox: queue.Queue, stop: threading.Event) -> None:
    """Accepts connections until ``stop``; each one's handshake runs in its own thread, so a
    silent or slow peer holds only its own (bounded by `_HANDSHAKE_S`)."""
    self._listener.settimeout(0.1)  # to see `stop`
    while not stop.is_set():
      try:
        raw, peer = self._listener.accept()
      except TimeoutError:
        continue
      except OSError:  # the listener was closed
        return
      raw.setblocking(True)
      threading.Thread(
        target=self._handshake, args=(raw, f"{peer[0]}:{peer[1]}", inbox), daemon=True
      ).start()

  def _handshake(self, raw: socket.socket, peer: str, inbox: queue.Queue) -> None:
    """Authenticates one connection and reads its hello; puts ``(conn, hello, peer)`` or
    ``(None, reason, peer)`` into ``inbox``. The handshake is the one
    ``multiprocessing.connection.Listener.accept`` runs, cut off after `_HANDSHAKE_S`."""
    conn = mpc.Connection(raw.detach())
    cut = threading.Event()
    watchdog = threading.Timer(_HANDSHAKE_S, _cut, args=(conn, cut))
    watchdog.start()
    try:
      mpc.deliver_challenge(conn, self._authkey)
      mpc.answer_challenge(conn, self._authkey)
      hello = wire.recv(conn, ("control", "storage"), f"the peer at {peer}")
    except mpc.AuthenticationError:
      reason = "presented a wrong token"
    except wire.WireError as e:
      reason = str(e).removeprefix(f"the peer at {peer} ").rstrip(".")
    except (EOFError, OSError):
      reason = (
        f"said nothing within {_HANDSHAKE_S:g} s"
        if cut.is_set()
        else "closed the connection during the handshake"
      )
    else:
      inbox.put((tuned(conn), hello, peer))
      return
    finally:
      watchdog.cancel()
    logging.warning("the rollout endpoint refused the peer at %s: it %s.", peer, reason)
    conn.close()
    inbox.put((None, reason, peer))

  def _attach(self, hosts: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    inbox: queue.Queue = queue.Queue()
    stop = threading.Event()
    acceptor = threading.Thread(target=self._accept_loop, args=(inbox, stop), daemon=True)
    acceptor.start()
    pending: dict[int, tuple[mpc.Connection, str]] = {}  # unit id -> control conn awaiting storage
    events: list[str] = []  # what happened to peers that did not attach, for the final message
    try:
      while len(self._hosts) < hosts:
        try:
          conn, hello, peer = inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
          raise TimeoutError from None
        if conn is None:
          events.append(f"the peer at {peer} {hello}")
          continue
        try:
          self._admit(conn, hello, peer, hosts, pending, deadline)
        except _Dropped as e:
          logging.warning("%s", e)
          events.append(str(e))
          conn.close()
    except TimeoutError:
      events += [f"{who} never opened its storage connection" for _, who in pending.values()]
      raise TimeoutError(
        f"{len(self._hosts)} of {hosts} rollout hosts attached to {self.address} within "
        f"{timeout_s:.0f} s{_listing(events)}; start them with `python -m knitjax.main "
        "--role=rollout` and the same --config and --workdir (config.topology.rollout_hosts)."
      ) from None
    finally:
      stop.set()
      self._listener.close()
      acceptor.join()
      for c, _ in pending.values():
        c.close()
      while not inbox.empty():  # handshakes that finished after the last host was in
        if (late := inbox.get_nowait()[0]) is not None:
          late.close()

  def _admit(self, conn, hello, peer, hosts, pending, deadline) -> None:
    """Takes one authenticated connection: a host's control connection (unit id, layout,
    weights address) or its storage connection (the host then starts serving). A host that goes
    away or says something else meanwhile raises `_Dropped`; one that reports an error raises it."""
    if hello[0] == "control":
      _, hostname, pid = hello
      i = len(pending) + len(self._hosts)
      who = f"rollout host {i} ({hostname}, pid {pid}, {peer})"
      if i >= hosts:
        _quietly(wire.send, conn, "error", "ValueError", f"this run takes {hosts} rollout hosts.")
        raise _Dropped(f"{who} is one more than the {hosts} this run takes")
      _quietly(wire.send, conn, "welcome", i, self._paths)
      specs, mesh_shape, devices = self._await(conn, "ready", who, deadline)
      self._ensure_weights(specs, mesh_shape, who)
      _quietly(wire.send, conn, "weights", self._weights.address)
      pending[i] = (conn, who)
      logging.info("%s attached (%d devices).", who, devices)
      return
    (unit_id,) = hello[1:]
    if unit_id not in pending:
      raise _Dropped(
        f"the peer at {peer} opened a storage connection for unit {unit_id}, which "
        "no attaching host holds"
      )
    ctl, who = pending.pop(unit_id)
    try:
      _quietly(wire.send, ctl, "go")  # both connections are up: the host starts serving
      metas, capacity, stats, _ = self._await(ctl, "report", who, deadline)
    except _Dropped:
      ctl.close()
      raise
    unit = RemoteStorageUnit(conn, unit_id, who)
    host = _Host(unit_id, who, ctl, unit, capacity=capacity, stats=stats)
    self._hosts.append(host)
    self._hosts.sort(key=lambda h: h.index)

  @staticmethod
  def _await(conn: mpc.Connection, kind: str, who: str, deadline: float) -> tuple:
    """The arguments of the next ``kind`` message from an attaching host, by ``deadline``."""
    try:
      if not conn.poll(max(0.0, deadline - time.monotonic())):
        raise TimeoutError
      got, *args = wire.recv(conn, (kind, "error"), who)
    except (EOFError, OSError) as e:
      raise _Dropped(f"{who} closed the connection while attaching ({e!r})") from None
    except wire.WireError as e:
      raise _Dropped(str(e).rstrip(".")) from None
    if got == "error":
      raise_error(*args, who)
    return args

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
      wire.send(h.control, kind, *args)
    except OSError as e:
      raise HostError(f"{h.who} went away ({e!r}); {_RESUME}") from e

  def adopt(self, params, version: int) -> None:
    if version == self._version:
      return
    n = len(self._hosts)
    ids = [version * n + h.index for h in self._hosts]
    self._weights.stage(params, *ids)
    for h, pull_id in zip(self._hosts, ids, strict=True):
      self._send(h, "adopt", pull_id, version)
    self._version = version

  def capacity(self) -> int:
    # A host's room is its last report less the starts it had not read; a report that shrank
    # (its engine's own accounting) can leave that below 0, which is no room, not less.
    return sum(max(h.capacity, 0) for h in self._hosts)

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
      metas, capacity, h.stats, starts_seen = result(h.control, "report", h.who)
    except (EOFError, OSError) as e:
      raise HostError(f"{h.who} went away ({e!r}); {_RESUME}") from e
    except wire.WireError as e:
      raise HostError(f"{str(e).rstrip('.')}; {_RESUME}") from None
    # Starts the host had not read yet when it reported are not in its capacity.
    h.capacity = capacity - (h.starts_sent - starts_seen)
    h.inflight -= len(metas)
    return metas

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
        wire.send(h.control, "close")
      h.control.close()
      h.unit.close()
    self._hosts = []
    self._listener.close()
