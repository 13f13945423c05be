"""The fault suite's fast parts: fault points and backpressure (the long suite is
``python -m lab.faults``, figures in docs/reliability.md)."""

import json
import os
import subprocess
import sys

import pytest

from knitjax import faultpoints
from lab.faults import backpressure

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = (
  "from knitjax import faultpoints\nfor _ in range(3): faultpoints.point('update')\nprint('x')"
)


def _run(env):
  env = {**os.environ, "PYTHONPATH": REPO, **env}
  return subprocess.run(
    [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True
  )


def test_an_armed_point_kills_the_process_the_nth_time(tmp_path):
  killed = _run({"KNITJAX_KILL_AT": "update:2"})
  assert killed.returncode == -9 and killed.stdout == ""
  counts = tmp_path / "counts.json"
  passed = _run({"KNITJAX_KILL_AT": "update:4", "KNITJAX_FAULT_COUNTS": str(counts)})
  assert passed.returncode == 0 and passed.stdout == "x\n"
  assert json.loads(counts.read_text()) == {"update": 3}


@pytest.mark.parametrize("spec", ["update", "update:0", "nowhere:1", "update:x"])
def test_a_bad_kill_spec_is_one_sentence(spec):
  with pytest.raises(ValueError, match=r"KNITJAX_KILL_AT=.* is not accepted; give <point>:"):
    faultpoints._parse(spec)


def test_backpressure_holds_the_byte_budget_without_deadlock():
  out = backpressure.run(seconds=2.0, log=lambda *_: None)
  assert out["budget_held"] and not out["deadlock"], out
  assert out["blocked_puts"] > 0  # the producer was held back, not buffered
  assert out["consume_rate_groups_per_s"] < out["produce_rate_groups_per_s"]


@pytest.mark.parametrize(
  ("rc", "stderr", "outcome"),
  [
    (None, "", ["hangs"]),
    (1, "Traceback (most recent call last):\n  ...\nKeyError: 'x'", ["tracebacks"]),
    (0, "", ["silent_accepts"]),
    (1, "I1206 log line\nerror: --workdir /w is a file.", ["rejected"]),
    (1, "error: something is wrong.", ["rejected", "not_named"]),
    (1, "Killed", ["rejected", "not_one_sentence", "not_named"]),
  ],
)
def test_entry_point_outcomes(rc, stderr, outcome):
  from lab.faults import entry_points

  assert entry_points.classify(rc, stderr, ("/w",)) == outcome
