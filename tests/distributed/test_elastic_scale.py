"""Scaling the Ray rollout workers of a running run: the command's refusals, the run's watch, and
the elastic benchmark's quick run (1 -> 3 -> 1 Ray workers mid-run: quotas, depth bound and
conservation by group id hold, and the new workers generate groups)."""

import json
import os
import subprocess
import sys

import pytest

from knitjax.distributed import elastic

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _scale(workdir, n) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", "knitjax.scale", f"--workdir={workdir}", f"--rollout_workers={n}"],
    cwd=REPO,
    env={**os.environ, "PYTHONPATH": REPO},
    capture_output=True,
    text=True,
    timeout=60,
  )


def test_the_command_refuses_bad_input_in_one_sentence(tmp_path):
  r = _scale(tmp_path, 0)
  assert r.returncode == 1
  assert r.stderr.strip() == "error: --rollout_workers=0 is not allowed; give 1 or more."
  r = _scale(tmp_path / "nothing", 2)
  assert r.returncode == 1 and "holds no run (no .lock file there)" in r.stderr
  assert len(r.stderr.strip().splitlines()) == 1
  (tmp_path / ".lock").write_text("{}")  # a run, but one without Ray workers (no status file)
  r = _scale(tmp_path, 2)
  assert r.returncode == 1 and "has no Ray rollout workers to scale" in r.stderr
  assert not (tmp_path / elastic.REQUEST).exists()


class _Rollout:
  """What the watch asks of a Ray rollout."""

  def __init__(self):
    self.asked, self._members = [], {"working": [0], "joining": []}

  def scale(self, n):
    self.asked.append(n)

  def members(self):
    return dict(self._members)


def test_the_watch_applies_each_new_request_once_and_records_the_workers(tmp_path):
  (tmp_path / ".lock").write_text("{}")
  rollout = _Rollout()
  watch = elastic.ScaleWatch(str(tmp_path), rollout, 1)
  status = json.loads((tmp_path / elastic.STATUS).read_text())
  assert status["rollout_workers"] == 1 and status["working"] == [0]
  assert status["pid"] == os.getpid()
  line = elastic.request(str(tmp_path), 3)
  assert "for 3 Ray rollout workers (it had asked for 1)" in line
  watch.poll()
  watch.poll()  # the same request again: nothing more
  assert rollout.asked == [3]
  rollout._members = {"working": [0, 1, 2], "joining": []}
  watch.poll()
  assert json.loads((tmp_path / elastic.STATUS).read_text())["working"] == [0, 1, 2]
  (tmp_path / elastic.REQUEST).write_text('{"rollout_workers": "many"}')  # by hand: ignored
  watch.poll()
  assert rollout.asked == [3]
  elastic.request(str(tmp_path), 1)
  watch.poll()
  assert rollout.asked == [3, 1]
  # a later process of the same run starts with the count last asked for
  again = _Rollout()
  elastic.ScaleWatch(str(tmp_path), again, 3)
  assert again.asked == [1]


def test_elastic_bench_quick_scales_1_to_3_to_1_and_loses_nothing(tmp_path):
  pytest.importorskip("ray")
  from configs.bench import elastic as elastic_config
  from lab.bench import elastic as bench

  out = bench.run(elastic_config.get_config("quick"), str(tmp_path))
  assert out["quota_violations"] == 0
  assert out["version_bound_violations"] == 0
  assert out["groups_lost"] == 0 and out["consumed_twice"] == 0
  assert (
    out["groups_offered"] == out["groups_consumed"] + out["groups_rejected"] + out["groups_pending"]
  )
  groups = out["groups_per_worker"]
  assert sorted(groups) == ["0", "1", "2"]
  assert all(groups[w] > 0 for w in ("1", "2"))  # the new workers took groups
  assert out["seconds_to_first_group"] is not None
  assert out["workers_at_end"] == [0]  # back to one
  assert [r["workers"] for r in out["requests"]] == [3, 1]
  assert set(out["phases"]) == {"before", "scaled", "after"}
  assert os.path.exists(tmp_path / "elastic.json") and os.path.exists(tmp_path / "elastic.png")
