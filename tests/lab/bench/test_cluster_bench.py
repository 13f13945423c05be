"""The cluster bench's pieces that need no cluster: its configs, its refusal without root, how it
reads the runs it started (the cluster itself is tested in tests/lab/cluster)."""

import json
import os
import sys

import pytest

from lab.bench import cluster as bench
from lab.cluster import scale

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)
from configs.bench import cluster as cluster_config  # noqa: E402


def test_configs_name_a_valid_real_workload():
  for arg in (None, "quick"):
    c = cluster_config.get_config(arg)
    w = scale.RealWorkload(**dict(c.real))
    assert scale.real_compute(w)["naive_s"] > 0
  with pytest.raises(ValueError, match="choose: quick"):
    cluster_config.get_config("nope")


def test_without_root_the_bench_stops_with_one_sentence(monkeypatch, tmp_path):
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  with pytest.raises(ValueError, match=r"^the emulated cluster needs root"):
    bench.run(cluster_config.get_config("quick"), str(tmp_path))


def test_weight_sync_reads_each_disaggregated_runs_publish_timings(tmp_path):
  for name, seconds, nbytes in (("a", 0.05, 300544.0), ("b", 0.1, 300544.0), ("c", 0.0, 0.0)):
    (tmp_path / name).mkdir()
    timings = {"weight_publish_s_mean": seconds, "weight_publish_bytes_mean": nbytes}
    (tmp_path / name / "timings.json").write_text(json.dumps(timings))
  (tmp_path / "colocated").mkdir()
  (tmp_path / "colocated" / "timings.json").write_text(json.dumps({"slots": 32}))
  ws = bench._weight_sync(str(tmp_path))
  assert ws["bytes"] == 300544
  assert ws["per_run"] == {
    "a": {"seconds": 0.05, "bytes": 300544},
    "b": {"seconds": 0.1, "bytes": 300544},
  }
  assert ws["seconds"] == 0.1  # the median of the runs that published
  assert bench._weight_sync(str(tmp_path / "colocated")) is None


def test_the_dilation_input_is_the_centralized_compute_per_row():
  mm = {
    "main": {
      "workload": {"groups_per_step": 4, "group_size": 8},
      "centralized": {"step_compute_s": 3.2},
    }
  }
  assert bench._naive_s_per_row(mm) == pytest.approx(0.1)


def test_a_second_concurrent_bench_is_refused_in_one_sentence(tmp_path):
  import fcntl

  with bench.one_at_a_time(str(tmp_path)):
    lock = tmp_path / bench.LOCK_FILE
    assert lock.read_text() == str(os.getpid()) and lock.stat().st_mode & 0o077 == 0
    with pytest.raises(ValueError) as e, bench.one_at_a_time(str(tmp_path)):
      pass
    assert str(e.value) == (
      f"another cluster benchmark is running (pid {os.getpid()}, holding {lock}); wait for it to "
      "end: two at once share the cores and would measure different dilations."
    )
  # Released at the end: the next run takes it, and holds it against any other open file.
  with bench.one_at_a_time(str(tmp_path)), open(lock) as f, pytest.raises(BlockingIOError):
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_rays_temp_folder_is_owner_only_and_a_dead_runs_is_removed(tmp_path):
  from lab.cluster import ray_nodes

  stale = tmp_path / "ray_kj999999h"
  (stale / "ray" / "session_latest").mkdir(parents=True)
  live, other = tmp_path / "ray_kj4242", tmp_path / "ray_footprint.json"
  live.mkdir()
  other.write_text("{}")
  folder = ray_nodes.private_temp_dir("kj123", "h", root=str(tmp_path), alive=lambda p: p != 999999)
  assert folder == str(tmp_path / "ray_kj123h")
  assert os.stat(folder).st_mode & 0o777 == 0o700
  assert not stale.exists() and live.exists() and other.exists()
