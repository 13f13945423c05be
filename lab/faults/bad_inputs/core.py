"""The bad-input driver: what a bad input is, how its outcome is counted, how examples are drawn.

`allocate` splits the examples over the kinds, `generate` a kind's over its cases, and
`generate_case` has hypothesis draw each case's inputs; `Tally` records what each input did.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import signal
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import hypothesis
from hypothesis import HealthCheck, Phase
from hypothesis import strategies as st

KIND_WEIGHTS = {
  "configs": 4000,
  "payloads": 2860,
  "group_meta": 1000,
  "prompt_files": 1500,
  "hf_checkpoints": 400,
  "checkpoints": 100,
  "model_folders": 140,
  "config_extremes": 0,  # exhaustive: every field's extremes once (see `allocate`)
}
COUNTERS = (
  "examples",
  "rejected",
  "tracebacks",
  "silent_accepts",
  "not_one_sentence",
  "not_named",
  "hangs",
  "accepted",
)
# An isolated input runs in a forked child with this much address space beyond what the parent
# had mapped at the fork: an input that makes the code allocate without bound (a template's
# ``'x' * 10**12``) fails there, not in the suite.
ISOLATED_MEMORY_BYTES = 4 << 30
MAX_FAILURES = 40  # failures listed: the first of each (kind, case, outcome, exception type)

Draw = Callable[[st.SearchStrategy], Any]


@dataclasses.dataclass(frozen=True)
class BadInput:
  """One generated bad input.

  Attributes:
    description: what was corrupted, for the failure list.
    names: the rejection must contain one of these (the field, file or array corrupted).
    call: feeds the input to the function that must reject it.
    file_errors: a ``FileNotFoundError`` counts as a rejection too.
    timeout_s: when set, the call runs in a forked child (no JAX in it: only host code) with
      `ISOLATED_MEMORY_BYTES` of address space and is counted as a hang after this many seconds.
  """

  description: str
  names: tuple[str, ...]
  call: Callable[[], Any]
  file_errors: bool = False
  timeout_s: float | None = None
  may_accept: str | None = None  # why accepting this input is right too (counted as "accepted")


class Hang(Exception):
  """An isolated call that did not return within its ``timeout_s``."""


class _ChildError(Exception):
  """An exception raised in an isolated child, carried back by type name and message."""

  def __init__(self, mro: list[str], message: str):
    super().__init__(message)
    self.mro = mro  # the names of the exception's type and its bases


def _mapped_bytes() -> int:
  """This process's mapped address space (what RLIMIT_AS counts)."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _isolated(call: Callable[[], Any], timeout_s: float) -> None:
  """Runs ``call`` in a forked child; re-raises what it raised (as `_ChildError`) or `Hang`."""
  read, write = os.pipe()
  with warnings.catch_warnings():  # JAX warns of any fork: the child runs host code only
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
    pid = os.fork()
  if pid == 0:  # the child: report one JSON line, then leave without running any cleanup
    os.close(read)
    try:
      limit = _mapped_bytes() + ISOLATED_MEMORY_BYTES
      resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
      call()
      out = {"ok": True}
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which classifies it
      mro = [t.__name__ for t in type(e).__mro__]
      out = {"ok": False, "mro": mro, "message": str(e)[:2000]}
    os.write(write, json.dumps(out).encode())
    os._exit(0)
  os.close(write)
  deadline = time.monotonic() + timeout_s
  while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      break
    if time.monotonic() > deadline:
      os.kill(pid, signal.SIGKILL)
      os.waitpid(pid, 0)
      os.close(read)
      raise Hang(f"no answer within {timeout_s:.0f} s")
    time.sleep(0.01)
  with os.fdopen(read, "rb") as f:
    blob = f.read()
  if not blob:
    raise _ChildError(["Died"], f"the child died with status {status}")
  out = json.loads(blob)
  if not out["ok"]:
    raise _ChildError(out["mro"], out["message"])


Case = tuple[str, Callable[[Draw, dict], BadInput]]


def classify(bad: BadInput) -> tuple[tuple[str, ...], Exception | None]:
  """Feeds one bad input; returns the counters it adds to and the exception it raised."""
  accepted = ("ValueError", "FileNotFoundError") if bad.file_errors else ("ValueError",)
  try:
    if bad.timeout_s is None:
      bad.call()
    else:
      _isolated(bad.call, bad.timeout_s)
  except Hang as e:
    return ("hangs",), e
  except Exception as e:  # noqa: BLE001 - the exception is what is being classified
    if not _is_a(e, accepted):
      return ("tracebacks",), e
    message = str(e)
    outcome = ["rejected"]
    if "\n" in message or "Traceback" in message or not message.strip():
      outcome.append("not_one_sentence")
    if not any(n in message for n in bad.names):
      outcome.append("not_named")
    return tuple(outcome), e
  return ("accepted" if bad.may_accept else "silent_accepts",), None


def error_name(e: Exception | None) -> str:
  """The exception's type name (for an isolated child's, the type it raised there)."""
  if isinstance(e, _ChildError):
    return e.mro[0]
  return type(e).__name__


def _is_a(e: Exception, names: tuple[str, ...]) -> bool:
  """Whether ``e`` (or the exception an isolated child raised) is one of the named types."""
  mro = e.mro if isinstance(e, _ChildError) else [t.__name__ for t in type(e).__mro__]
  return any(name in names for name in mro)


class Tally:
  """Counters by kind and by case, and the first failure of each signature."""

  def __init__(self):
    self.by_kind: dict[str, dict[str, int]] = {}
    self.by_case: dict[str, dict[str, int]] = {}
    self.failures: list[dict] = []
    self._seen: set[tuple] = set()

  def add(self, kind: str, case: str, bad: BadInput) -> None:
    outcome, err = classify(bad)
    for table, key in ((self.by_kind, kind), (self.by_case, f"{kind}/{case}")):
      counts = table.setdefault(key, dict.fromkeys(COUNTERS, 0))
      counts["examples"] += 1
      for name in outcome:
        counts[name] += 1
    failed = tuple(o for o in outcome if o not in ("rejected", "accepted"))
    signature = (kind, case, failed, error_name(err))
    if failed and signature not in self._seen and len(self.failures) < MAX_FAILURES:
      self._seen.add(signature)
      self.failures.append(
        {
          "kind": kind,
          "case": case,
          "outcome": ",".join(failed),
          "input": bad.description[:300],
          "error": None if err is None else error_name(err),
          "message": None if err is None else str(err)[:500],
        }
      )


def generate(kind: str, n: int, seed: int, cases: list[Case], ctx: dict, tally: Tally) -> None:
  """Runs ``n`` examples of ``kind``, split evenly over its cases."""
  for i, (name, make) in enumerate(cases):
    want = n // len(cases) + (i < n % len(cases))
    generate_case(
      want, seed, lambda draw, name=name, make=make: tally.add(kind, name, make(draw, ctx))
    )


def generate_case(n: int, seed: int, example: Callable[[Draw], None]) -> None:
  """Calls ``example`` ``n`` times, each with hypothesis' ``draw``."""
  done = 0
  # Hypothesis stops early once it has drawn every input a small case can make; run it again.
  for attempt in range(n):
    if done >= n:
      return

    @hypothesis.seed(seed * 1009 + attempt)
    @hypothesis.settings(
      max_examples=n - done,
      database=None,
      deadline=None,
      derandomize=False,
      phases=[Phase.generate],
      suppress_health_check=list(HealthCheck),
      print_blob=False,
    )
    @hypothesis.given(st.data())
    def one(data):
      nonlocal done
      if done < n:
        example(data.draw)
        done += 1

    one()


def allocate(examples: int, minimum: Mapping[str, int]) -> dict[str, int]:
  """Examples per kind: ``examples`` split by `KIND_WEIGHTS`, at least ``minimum[kind]``."""
  total = sum(KIND_WEIGHTS.values())
  return {k: max(minimum[k], round(examples * w / total)) for k, w in KIND_WEIGHTS.items()}


def baseline(what: str, call: Callable[[], Any]) -> None:
  """A pristine input must be accepted, or the corruptions of it prove nothing."""
  try:
    call()
  except Exception as e:
    raise RuntimeError(f"the pristine {what} is rejected ({type(e).__name__}: {e}).") from e


def fresh_copy(ctx: dict, source: str = "pristine") -> str:
  """A fresh copy of ``ctx[source]``, at a new path (no cache may know it); the last is removed."""
  if ctx["last"]:
    shutil.rmtree(ctx["last"], ignore_errors=True)
  ctx["n"] += 1
  ctx["last"] = dest = os.path.join(ctx["folder"], f"example_{ctx['n']}")
  shutil.rmtree(dest, ignore_errors=True)  # left by an earlier run in this workdir
  shutil.copytree(ctx[source], dest)
  return dest
