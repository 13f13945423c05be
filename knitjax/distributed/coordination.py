"""The coordination service of JAX's distributed runtime, as a run's processes use it.

Its key-value store (held open by ``jax.distributed``, served by process 0) carries what one
process announces to the others (`announce`, `hear`, `forget`), and each process's pulse:
`PulseWatch` ends a process with one sentence when another one is lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time

import jax

from knitjax import jax_compat

PULSE_S = 1.0  # each process counts up its pulse in the key-value store this often
SILENCE_S = 30.0  # a process whose pulse stops this long is taken for dead
_PREFIX = "knitjax/"


def _store() -> jax_compat.KeyValueStore:
  store = jax_compat.key_value_store()
  if store is None:
    raise RuntimeError(
      "a multi-process trainer needs JAX's distributed runtime: run with --distributed."
    )
  return store


def announce(key: str, value) -> None:
  """Sets ``key`` to ``value`` (JSON) in the coordination service's key-value store."""
  _store().set(_PREFIX + key, json.dumps(value))


def hear(key: str, timeout_s: float):
  """The JSON value of ``key``, waiting up to ``timeout_s``; None if it did not come in time."""
  try:
    raw = _store().get(_PREFIX + key, timeout_s)
  except Exception as e:  # not a timeout: the runtime's error for a lost service
    raise RuntimeError(
      f"trainer process {jax.process_index()} lost the coordination service (process 0) while "
      f"waiting for {key!r}: {str(e).splitlines()[0]}"
    ) from e
  return None if raw is None else json.loads(raw)


def forget(key: str) -> None:
  # a key already gone, or the service going down at the end
  with contextlib.suppress(Exception):
    _store().delete(_PREFIX + key)


class PulseWatch:
  """Ends this process with one sentence when another trainer process dies.

  A thread counts this process's pulse up in the key-value store every ``PULSE_S`` and reads
  the others'. A pulse that stops for ``silence_s`` (kill -9, a lost host), or a store that is
  gone (process 0, which holds it, died), writes one line to stderr and exits the process with
  status 1: the survivors may be blocked inside a collective that never returns, and JAX's own
  heartbeat check would only abort them later with a stack trace. Nothing is lost: the run
  resumes from its last checkpoint, whose logs are cut back to what it covers. ``end()`` marks
  a process that finished, so its silence is not a death, or one that stopped early (SIGTERM,
  Ctrl-C, an error), which the others then name within a pulse.
  """

  def __init__(self, *, silence_s: float = SILENCE_S):
    import threading

    self.process, self.processes = jax.process_index(), jax.process_count()
    self._silence = silence_s
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, name="pulse-watch", daemon=True)
    self._thread.start()

  def _loop(self) -> None:
    store = _store()
    seen = {k: (None, time.monotonic()) for k in range(self.processes) if k != self.process}
    while not self._stop.wait(PULSE_S):
      try:
        store.increment(f"{_PREFIX}pulse/{self.process}", 1)
        for k, (last, since) in list(seen.items()):
          if store.try_get(f"{_PREFIX}done/{k}") is not None:
            del seen[k]
            continue
          if store.try_get(f"{_PREFIX}left/{k}") is not None:
            self._leave()
            _die(_left_sentence(k))
          pulse = store.try_get(f"{_PREFIX}pulse/{k}")
          now = time.monotonic()
          if pulse != last:
            seen[k] = (pulse, now)
          elif now - since > self._silence:
            self._leave()
            _die(
              f"trainer process {k} sent no pulse for {self._silence:.0f} s (killed, or its host "
              "was lost); this process stops too. Restart every trainer process to resume "
              "from the last checkpoint."
            )
      except Exception as e:  # noqa: BLE001 - the store itself is gone
        if self._stop.is_set():
          return
        _die(
          f"trainer process {self.process} lost the coordination service of process 0 "
          f"({str(e).splitlines()[0][:120]}); this process stops too. Restart every trainer "
          "process to resume from the last checkpoint."
        )

  def _leave(self) -> None:
    """Marks this process as stopping early, for the others (and process 0's wait)."""
    with contextlib.suppress(Exception):
      _store().set(f"{_PREFIX}left/{self.process}", "1", overwrite=True)

  def end(self, *, finished: bool) -> None:
    """This process ends: after its last step (``finished``: the others stop watching it), or
    before it (stopped by a signal or an error: the others stop within a pulse, naming it,
    instead of waiting ``silence_s`` or failing inside a collective)."""
    if not finished:  # keep watching: a close that then waits on a lost peer still ends
      self._leave()
      if self.process == 0:  # it holds the service: the others stop first, or JAX aborts them
        others = [k for k in range(self.processes) if k != self.process]
        deadline = time.monotonic() + 3 * PULSE_S
        while time.monotonic() < deadline and not all(map(_ended, others)):
          time.sleep(0.05)
      return
    self._stop.set()
    self._thread.join(timeout=10)
    with contextlib.suppress(Exception):
      _store().set(f"{_PREFIX}done/{self.process}", "1", overwrite=True)


def _ended(k: int) -> bool:
  with contextlib.suppress(Exception):
    store = _store()
    return any(store.try_get(f"{_PREFIX}{w}/{k}") is not None for w in ("done", "left"))
  return True  # the store is gone: nobody is waiting for this process any more


def _left_sentence(k: int) -> str:
  return (
    f"trainer process {k} stopped before the last step (interrupted, or it failed: its own "
    "log says why); this process stops too. Restart every trainer process to resume from the "
    "last checkpoint."
  )


def peer_left(wait_s: float = 0.0) -> str | None:
  """The sentence naming another process of this run that stopped before its last step, else
  None: an error of this process's (a collective whose peer went away) is then that, and the
  entry point says so instead of a stack trace.

  ``wait_s``: how long to wait for a verdict. A process killed outright (SIGKILL) leaves no mark,
  and a collective with it fails at once ("Connection reset by peer") while the pulse watch
  names it only after ``SILENCE_S``: waiting that long lets the watch end this process with its
  one sentence (exit 1) instead of the collective's stack trace.
  """
  if jax.process_count() < 2:
    return None
  store = jax_compat.key_value_store()
  deadline = time.monotonic() + wait_s
  while True:
    for k in range(jax.process_count()):
      if k != jax.process_index() and store is not None:
        with contextlib.suppress(Exception):
          if store.try_get(f"{_PREFIX}left/{k}") is not None:
            return _left_sentence(k)
    if time.monotonic() >= deadline:
      return None
    time.sleep(PULSE_S)


_said: set[str] = set()  # sentences the entry point already printed (not printed twice)


def said(sentence: str) -> str:
  _said.add(sentence)
  return sentence


def _die(sentence: str) -> None:
  import sys

  if sentence not in _said:
    sys.stderr.write(f"error: {sentence}\n")
    sys.stderr.flush()
  os._exit(1)


IDENTITY_TIMEOUT_S = 120.0  # how long a process waits for another's identity at the start


def flat_config(config) -> dict:
  """``config`` (a frozen dataclass tree) as ``{"section.field": value}``, values as JSON has
  them (tuples become lists), so two processes' configs compare field by field."""

  def walk(prefix: str, value, out: dict) -> None:
    if dataclasses.is_dataclass(value):
      for f in dataclasses.fields(value):
        walk(f"{prefix}{f.name}.", getattr(value, f.name), out)
    else:
      out[prefix[:-1]] = json.loads(json.dumps(value, default=repr))

  out: dict = {}
  walk("", config, out)
  return out


def first_difference(mine: dict, theirs: dict) -> tuple[str, object, object, int] | None:
  """``(key, mine, theirs, how many keys differ)`` of the first key that differs, else None."""
  keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
  if not keys:
    return None
  return keys[0], mine.get(keys[0]), theirs.get(keys[0]), len(keys)


def check_one_run(config, workdir: str, *, timeout_s: float = IDENTITY_TIMEOUT_S) -> None:
  """Every process of a ``--distributed`` run holds the same config and workdir.

  Each process announces its identity (the workdir's absolute path and the config, field by
  field) and compares every other process's with its own, so a difference is found, and named
  in one sentence, on every process before anything is built. Without this, a process started
  with another learning rate or seed trains "replicated" parameters that drift apart, and one
  with fewer steps leaves the others waiting in a collective.

  Raises:
    ValueError: another process has another workdir or config (one sentence naming the field).
    TimeoutError: a process announced nothing within ``timeout_s``.
  """
  k = jax.process_index()
  mine = {"workdir": os.path.abspath(workdir), **flat_config(config)}
  announce(f"identity/{k}", mine)
  for j in range(jax.process_count()):
    if j == k:
      continue
    theirs = hear(f"identity/{j}", timeout_s)
    if theirs is None:
      raise TimeoutError(
        f"trainer process {k} heard nothing from process {j} within {timeout_s:.0f} s of "
        "starting: start every process of the run."
      )
    diff = first_difference(mine, theirs)
    if diff is not None:
      key, here, there, n = diff
      name = key if key == "workdir" else f"config.{key}"
      more = f" (and {n - 1} more fields)" if n > 1 else ""
      raise ValueError(
        f"trainer processes {k} and {j} were started differently: {name} is {here!r} here and "
        f"{there!r} in process {j}{more}; start every process with the same --config, flags "
        "and --workdir."
      )
