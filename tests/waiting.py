"""Waiting on a condition in tests: poll it until it holds, up to a generous deadline.

Tests wait on events, files or counters, never on a fixed sleep that hopes something happened:
on a loaded 2-core CI machine a sleep that is long enough on a quiet one is not.
"""

import time


def wait_until(predicate, *, timeout_s: float = 60.0, what: str = "the condition") -> None:
  """Returns as soon as ``predicate()`` is true; fails the test after ``timeout_s`` seconds."""
  deadline = time.monotonic() + timeout_s
  while not predicate():
    if time.monotonic() > deadline:
      raise AssertionError(f"{what} did not hold within {timeout_s} s")
    time.sleep(0.005)
