"""Named points where the fault suite (`lab.faults`) kills a run with SIGKILL.

A point costs one dict lookup when no fault is armed. ``KNITJAX_KILL_AT=<name>:<n>`` kills the
process the ``n``-th time it passes ``<name>``; ``KNITJAX_FAULT_COUNTS=<file>`` writes how often
each point was passed to ``<file>`` (JSON) when the process exits, so a suite can pick kill points
that a run reaches. The points are listed in :data:`POINTS`.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import signal
import threading

POINTS = {
  "rollout": "a rollout call returned groups (before they are offered)",
  "admission": "a group was offered to the admission index",
  "fetch": "a consumer fetched a mini-batch's payloads",
  "update": "an optimizer update was applied (before its metrics are logged)",
  "weight_sync": "new weights were published to the rollout",
  "checkpoint": "a checkpoint save was started (its files are being written)",
}

_lock = threading.Lock()
_counts: collections.Counter = collections.Counter()
_armed: tuple[str, int] | None = None
_record = os.environ.get("KNITJAX_FAULT_COUNTS", "")


def _parse(spec: str) -> tuple[str, int] | None:
  if not spec:
    return None
  name, _, n = spec.partition(":")
  if name not in POINTS or not n.isdigit() or int(n) < 1:
    raise ValueError(
      f"KNITJAX_KILL_AT={spec!r} is not accepted; give <point>:<n >= 1> with a point among "
      f"{', '.join(POINTS)}."
    )
  return name, int(n)


_armed = _parse(os.environ.get("KNITJAX_KILL_AT", ""))


def _write_counts() -> None:
  with open(_record, "w") as f:
    json.dump(dict(_counts), f)


if _record:
  atexit.register(_write_counts)


def point(name: str) -> None:
  """Marks that the run passed point ``name``; kills the process there if a fault is armed."""
  if _armed is None and not _record:
    return
  with _lock:
    _counts[name] += 1
    hit = _armed is not None and _armed == (name, _counts[name])
  if hit:
    os.kill(os.getpid(), signal.SIGKILL)
