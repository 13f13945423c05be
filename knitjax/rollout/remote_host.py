"""A rollout host's side of `knitjax.rollout.remote`: serve one rollout to the trainer.

:func:`serve` connects to the trainer's rollout endpoint (two authenticated connections),
builds the host's rollout and storage unit once the trainer has named its unit id
(``attach``), then generates on its own: it reads the trainer's messages (``start``, ``adopt``,
the base key, whether the trainer wants room) between steps, steps its rollout while it holds
groups, and reports after each step on the control connection; a thread answers storage calls
(``get``, ``put``, ``release``, ``stats``) on the other connection, until the trainer closes
the run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import connection as mpc

import jax

from knitjax import faultpoints
from knitjax.rollout import wire
from knitjax.rollout.contract import Rollout
from knitjax.rollout.remote import reply, result, split_address, tuned
from knitjax.transfer.storage import StorageUnit

_CALLS = ("start", "adopt", "seed", "room", "close")  # what the trainer sends while the host serves


@dataclasses.dataclass(frozen=True)
class Attached:
  """What the host builds once it knows its unit id: its rollout, unit and weight puller."""

  rollout: Rollout
  storage: StorageUnit
  mesh: jax.sharding.Mesh
  specs: list  # one PartitionSpec per published leaf, in the trainer's order
  # ``pull(weights_address)`` -> ``fetch(pull_id) -> params`` for ``rollout.adopt``
  puller: Callable[[str], Callable[[int], object]]


def connect(
  address: str | Callable[[], str], authkey: bytes, hello: tuple, timeout_s: float
) -> mpc.Connection:
  """Connects to the trainer and sends ``hello`` (a message: kind, args), retrying until
  ``timeout_s`` (it may not be listening yet).

  ``address`` may be a function, asked again before every try: a resumed trainer listens on a
  new port, and a host started before it may first read the previous run's address.

  Raises:
    ValueError: the trainer refused this host's token (one sentence naming the address).
  """
  deadline = time.monotonic() + timeout_s
  while True:
    where = address() if callable(address) else address
    try:
      conn = tuned(mpc.Client(split_address(where), authkey=authkey))
      wire.send(conn, *hello)
      return conn
    except mpc.AuthenticationError:
      raise ValueError(
        f"the trainer at {where} refused this rollout host's token; give the trainer and every "
        "host the same KNITJAX_ROLLOUT_TOKEN, or the same WORKDIR/rollout_token."
      ) from None
    except OSError:  # refused, reset, unreachable: not up (yet)
      if time.monotonic() > deadline:
        raise
      time.sleep(0.2)


def _serve_storage(conn: mpc.Connection, unit: StorageUnit) -> None:
  calls = {
    "put": unit.put,
    "get": unit.get,
    "get_images": unit.get_images,
    "release": unit.release,
    "stats": unit.stats,
  }
  while True:
    try:
      kind, *args = wire.recv(conn, tuple(calls), "the trainer")
    except (EOFError, OSError):
      return
    except wire.WireError as e:  # answered like a failed call; frames stay in step
      wire.send(conn, "error", "WireError", str(e))
      continue
    reply(conn, lambda kind=kind, args=args: calls[kind](*args))


def serve(
  address: str | Callable[[], str],
  authkey: bytes,
  attach: Callable[[int, list], Attached],
  *,
  timeout_s: float = 600.0,
) -> dict:
  """Runs one rollout host until the trainer closes the connection; returns its counters.

  Args:
    address: the trainer's rollout endpoint (or a function returning it, see `connect`).
    authkey: the run's token.
    attach: ``attach(unit_id, published_paths) -> Attached``: builds the rollout and its unit.
    timeout_s: how long to keep trying to reach the trainer.
  """
  control = connect(address, authkey, ("control", socket.gethostname(), os.getpid()), timeout_s)
  unit_id, paths = result(control, "welcome", "the trainer")
  try:
    a = attach(unit_id, paths)
  except Exception as e:  # the trainer says it in its own error, then this host fails too
    wire.send(control, "error", type(e).__name__, str(e))
    raise
  wire.send(control, "ready", a.specs, dict(a.mesh.shape), a.mesh.size)
  fetch = a.puller(result(control, "weights", "the trainer"))
  storage = connect(address, authkey, ("storage", unit_id), timeout_s)
  threading.Thread(target=_serve_storage, args=(storage, a.storage), daemon=True).start()
  wire.recv(control, ("go",), "the trainer")  # both connections are up
  counts = {"unit_id": unit_id, "groups": 0, "versions": 0, "steps": 0, "step_s": 0.0}
  # What each version weighs on the wire, and the seconds the versions took to arrive.
  counts["version_bytes"] = sum(
    math.prod(shape) * jax.numpy.dtype(dtype).itemsize for _, shape, dtype in paths
  )
  counts["pull_s"] = 0.0
  rollout, state = a.rollout, {"key": None, "room": False, "starts_seen": 0}

  def report(metas) -> None:
    wire.send(control, "report", metas, rollout.capacity(), rollout.stats(), state["starts_seen"])

  def handle(kind, *args) -> None:
    if kind == "start":
      rollout.start(*args)
      state["starts_seen"] += 1
    elif kind == "adopt":
      pull_id, version = args
      t0 = time.perf_counter()
      # The version crosses the link; waiting for its arrays here (the next step needs them
      # anyway) makes these seconds the pull's, not its dispatch's.
      params = jax.block_until_ready(fetch(pull_id))
      counts["pull_s"] += time.perf_counter() - t0
      rollout.adopt(params, version)
      counts["versions"] += 1
    elif kind == "seed":
      state["key"] = jax.random.wrap_key_data(args[0])
    elif kind == "room":
      state["room"] = args[0]
    else:
      raise ValueError(f"unknown message {kind!r} from the trainer.")

  with jax.set_mesh(a.mesh):
    report([])  # the first room
    while True:
      can_step = rollout.inflight and state["key"] is not None
      try:
        # Every message waiting, in order; with nothing to generate, wait for the next one.
        read = False
        while control.poll(0 if can_step or read else None):
          kind, *args = wire.recv(control, _CALLS, "the trainer")
          if kind == "close":
            raise EOFError
          handle(kind, *args)
          read = True
      except (EOFError, OSError):
        break  # the trainer closed the run, or is gone
      except Exception as e:  # a call failed: the trainer raises it, and this host stops
        wire.send(control, "error", type(e).__name__, str(e))
        raise
      if rollout.inflight and state["key"] is not None:
        t0 = time.perf_counter()
        key = jax.random.fold_in(state["key"], counts["steps"])
        metas = rollout.step(key, want_room=state["room"])
        counts["step_s"] += time.perf_counter() - t0
        counts["groups"] += len(metas)
        counts["steps"] += 1
        report(metas)
        faultpoints.point("rollout_host")
      elif read:
        report([])  # room changed without a step
  control.close()
  storage.close()
  rollout.close()
  return counts
