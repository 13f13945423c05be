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


def _bound_inputs():
  from knitjax.config import from_config_dict
  from lab.faults import kill_resume

  config = from_config_dict(kill_resume._config(kill_resume.RUNS["disaggregated"]))
  # B = 8 (4 arith, 4 think), M = 2, max_lag_steps = 1: 16 groups may start at versions 0-1,
  # 24 at versions 2-3, ...
  consumed, offered = [], []
  for step in range(3):
    for index in range(2):
      ids = list(range(8 * step + 4 * index, 8 * step + 4 * index + 4))
      consumed.append(
        {
          "step": step,
          "index": index,
          "consume_version": 2 * step + index,
          "group_ids": ids,
          "classes": ["arith", "arith", "think", "think"],
          "gen_versions": [max(0, 2 * step - 2)] * 4,
        }
      )
      offered += [
        {"group_id": g, "gen_version": max(0, 2 * step - 2), "rejected": False} for g in ids
      ]
  return consumed, offered, config


def test_check_bounds_passes_a_run_within_its_quotas_and_depth():
  from lab.faults import kill_resume

  consumed, offered, config = _bound_inputs()
  assert kill_resume.check_bounds(consumed, offered, config.admission, config.pipeline) == []
  assert kill_resume.staleness(consumed) == {"max_staleness": 3, "max_arch_staleness": 2}


def test_check_bounds_names_a_group_started_too_far_ahead_and_a_broken_quota():
  from lab.faults import kill_resume

  consumed, offered, config = _bound_inputs()
  offered[16]["gen_version"] = 1  # the 17th group started on weights of version 1: limit 16
  consumed[5]["classes"] = ["arith"] * 4
  problems = kill_resume.check_bounds(consumed, offered, config.admission, config.pipeline)
  assert problems == [
    "step 2 mini-batch 1 holds 0 think groups, outside 1..4",
    "step 2 consumed {'arith': 6, 'think': 2}, quotas {'arith': 4, 'think': 4}",
    "1 groups started beyond the pipeline-depth bound (max_lag_steps=1.0): group 16 (started "
    "17th, gen version 1, limit 16)",
  ]


def test_a_network_trial_is_judged_on_placement_hangs_and_how_the_trainer_stopped():
  from lab.faults import network

  placed = {"placement": {"_RolloutActor": [1], "_StorageActor": [1]}}
  failed = {"trainer_code": 1, "last_line": "error: x", "traceback": None}

  def judge(**first):
    return network._judge({**placed, **failed, **first}, failed, "/nonexistent")

  resumed_failed = "the resumed run failed: 'error: x'"
  assert judge() == [resumed_failed]  # stopped with one sentence: fine
  assert judge(traceback="Traceback ...", last_line="ray.exceptions.X: y") == [
    "the faulted run ended in a traceback: 'ray.exceptions.X: y'",
    resumed_failed,
  ]
  hung = judge(hung_after_s=360.4, stopped_by="SIGTERM", trainer_code=143)
  assert hung[0].startswith("the faulted trainer hung: still running 360 s after its start")
  elsewhere = judge(placement={"_RolloutActor": [0]})
  assert elsewhere[:2] == [
    "_RolloutActor ran on hosts [0], not on the Ray node's host 1",
    "_StorageActor ran on hosts None, not on the Ray node's host 1",
  ]


def test_the_processes_part_lists_its_cases_and_tables_a_result():
  from lab.faults import processes

  names = processes.cases()
  assert names == [
    "mismatch/seed",
    "mismatch/loop.steps",
    "hostile_peer/second_coordinator",
    "hostile_peer/garbage",
    "sigterm/one_process_ray",
    "sigterm/process_1",
  ]
  result = {
    "cases": {
      names[0]: {"ok": True, "outcome": "exit 1, 1: 'error: ...'", "problems": [], "seconds": 4},
      names[5]: {
        "ok": False,
        "outcome": "exit 1, -6",
        "problems": ["process 1 exited -6, not 143"],
        "seconds": 30,
      },
    }
  }
  assert processes.table_lines(result) == [
    "processes      | mismatch/seed: ok; exit 1, 1: 'error: ...'",
    "processes      | sigterm/process_1: FAIL process 1 exited -6, not 143; exit 1, -6",
  ]


def test_garbage_on_a_port_is_sent_whether_or_not_the_server_hangs_up():
  import socket
  import threading

  from lab.faults import processes

  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def hang_up():
      conn, _ = server.accept()
      conn.recv(10)
      conn.close()  # unread bytes: the client sees a reset

    threading.Thread(target=hang_up, daemon=True).start()
    assert processes._garbage(port, 1) is None
  assert processes._garbage(port, 0).startswith("no connection to send the garbage on")


def test_each_append_only_log_is_a_torn_log_case(tmp_path, monkeypatch):
  from lab.faults import workdir_faults

  for log in ("consumed.jsonl", "offered.jsonl", "fetched.p0.jsonl", "metrics.jsonl", "eval.jsonl"):
    assert f"torn/{log}" in workdir_faults.CASES
  monkeypatch.setattr(workdir_faults, "_finished_disaggregated", lambda _: None)
  case = workdir_faults.CASES["torn/fetched.p0.jsonl"]
  assert case(str(tmp_path / "torn" / "fetched"), "") == [
    "skipped: a one-process run writes no fetched.p0.jsonl"
  ]
  torn = tmp_path / "log.jsonl"
  torn.write_text('{"step": 1}\n' + workdir_faults.TORN_LINE)
  assert workdir_faults._whole_rows(str(torn)) is None
  torn.write_text('{"step": 1}\n{"step": 2}')
  assert workdir_faults._whole_rows(str(torn)) == [{"step": 1}, {"step": 2}]
