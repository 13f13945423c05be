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
