"""A ``gs://`` workdir: checkpoints, metrics, TensorBoard, plots and logs land in the bucket.

No real bucket is reachable here, so ``gs://`` is served by a fake: fsspec's ``gcs`` protocol
(the route epath takes for ``gs://``) maps ``gs://bucket/x`` to ``<tmp>/gcs/bucket/x``, and
orbax's TensorStore ``gcs`` kvstore is pointed at the same folder with the ``file`` driver.
Everything above the bytes (epath, orbax's GCS code paths such as its commit-file atomicity,
tensorboardX's writer registry) is the real code. The current directory is another temporary
folder, so anything that treats the URL as a local path (``os.path.abspath("gs://b/x")`` is
``<cwd>/gs:/b/x``) writes under ``<cwd>/gs:`` instead of into the bucket, and the tests fail.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils.epath import backend as epath_backend
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import _registry as fsspec_protocols
from orbax.checkpoint._src.path import gcs_utils

from configs import arith_tiny
from knitjax import workdir as wd
from knitjax.config import from_config_dict
from knitjax.run import train
from knitjax.runtime.evaluation import EvalLog, read_eval
from knitjax.runtime.metrics import MetricsWriter, plot_reward, read_metrics
from knitjax.runtime.preflight import check_workdir, checkpoint_steps
from knitjax.train.checkpoint import Checkpointer

URL = "gs://bucket/runs/a"


class _FakeGcs(DirFileSystem):
  """``gs://bucket/x`` -> ``<root>/bucket/x`` on the local disk."""

  protocol = ("gs", "gcs")
  cachable = False  # a fresh root per test
  root = ""

  def __init__(self, *args, **kwargs):  # takes gcsfs's options (finalize_on_close) and drops them
    super().__init__(path=self.root, fs=LocalFileSystem())


@pytest.fixture
def bucket(tmp_path, monkeypatch):
  """The local folder behind ``gs://bucket``; the test runs in a different current directory."""
  root = tmp_path / "gcs"
  (root / "bucket").mkdir(parents=True)
  monkeypatch.setattr(_FakeGcs, "root", str(root))
  monkeypatch.setitem(fsspec_protocols, "gs", _FakeGcs)
  monkeypatch.setitem(fsspec_protocols, "gcs", _FakeGcs)

  def kvstore(path):
    name, key = gcs_utils.parse_gcs_path(path, add_trailing_slash=False)
    return {"driver": "file", "path": str(root / name / key)}

  monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs", kvstore)
  # Orbax asks the GCS client whether the bucket has a hierarchical namespace; this one has not.
  monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
  epath_backend.fsspec_backend._get_filesystem.cache_clear()
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  yield root / "bucket" / "runs" / "a"
  epath_backend.fsspec_backend._get_filesystem.cache_clear()
  assert not (cwd / "gs:").exists(), "a gs:// path was treated as a local folder"


def test_path_keeps_urls_and_makes_local_paths_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert str(wd.path(URL, "checkpoints")) == "gs://bucket/runs/a/checkpoints"
  assert wd.is_remote(URL) and not wd.is_remote("runs/a")
  assert str(wd.path("runs/a", "metrics.jsonl")) == str(tmp_path / "runs/a/metrics.jsonl")


def test_checkpoints_go_to_the_bucket_and_restore(bucket):
  state = {"w": jnp.arange(8.0), "b": jnp.ones((2, 3))}
  ckpt = Checkpointer(URL, keep=2)
  assert str(ckpt.directory) == URL + "/checkpoints"
  for step in (1, 2, 3):
    ckpt.save(step, jax.tree.map(lambda x, s=step: x * s, state), {"version": 2 * step})
  ckpt.close()
  assert sorted(p.name for p in (bucket / "checkpoints").iterdir()) == ["2", "3"]  # keep=2
  # On gs:// orbax commits a step with a marker file instead of a rename.
  assert (bucket / "checkpoints" / "3" / "commit_success.txt").exists()
  ckpt = Checkpointer(URL)
  restored, meta = ckpt.restore(state)
  ckpt.close()
  assert meta == {"version": 6} and ckpt.restored_step == 3
  np.testing.assert_array_equal(restored["w"], np.arange(8.0) * 3)
  assert checkpoint_steps(URL) == [2, 3]


def test_metrics_eval_log_and_plot_go_to_the_bucket(bucket):
  w = MetricsWriter(URL, total_steps=4, primary=True, checkpoint_every=2, upload_every_s=1e9)
  w.write(1, {"reward_mean": 0.25})
  assert not (bucket / "metrics.jsonl").exists()  # step 1: no checkpoint, nothing uploaded yet
  w.write(2, {"reward_mean": 0.5})  # a checkpoint step: uploaded before the checkpoint is saved
  uploaded = (bucket / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in uploaded] == [1, 2]
  w.write(3, {"reward_mean": 0.75})
  w.close()
  assert [r["step"] for r in read_metrics(URL)] == [1, 2, 3]
  assert any(p.name.startswith("events.out.tfevents") for p in (bucket / "tb").iterdir())
  assert plot_reward(URL) == URL + "/reward.png"
  assert (bucket / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

  w = MetricsWriter(URL, total_steps=4, start_step=2, primary=True)  # resumed at step 2
  w.write(3, {"reward_mean": 1.0})
  w.close()
  assert [(r["step"], r["reward_mean"]) for r in read_metrics(URL)] == [
    (1, 0.25),
    (2, 0.5),
    (3, 1.0),
  ]

  log = EvalLog(URL, start_step=0)
  log.write(1, {"eval_greedy_accuracy": 0.5}, {"": [{"prompt_id": 0, "solved": True}]})
  assert log.done(1) and read_eval(URL) == [{"step": 1, "eval_greedy_accuracy": 0.5}]
  assert json.loads((bucket / "eval_answers_1.json").read_text())[0]["solved"] is True


def test_pipeline_logs_upload_whole_on_flush_and_resume_cut_back(bucket):
  from knitjax.runtime.pipeline import _jsonl_log

  log = _jsonl_log(URL, "consumed.jsonl", keep=lambda r: True)
  log.write({"step": 0})
  log.write({"step": 1})
  assert not (bucket / "consumed.jsonl").exists()  # nothing uploaded before a checkpoint
  log.flush()
  log.write({"step": 2})
  log.flush()
  log.close()
  assert (bucket / "consumed.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n{"step": 2}\n'
  log = _jsonl_log(URL, "consumed.jsonl", keep=lambda r: r["step"] < 2)  # resumed at step 2
  log.close()
  assert (bucket / "consumed.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'


def test_preflight_checks_a_bucket_workdir(bucket):
  config = from_config_dict(arith_tiny.get_config("quick"))
  check_workdir(config, URL)
  assert bucket.is_dir() and not list(bucket.iterdir())  # the write probe was deleted
  (bucket / "checkpoints" / "9").mkdir(parents=True)
  with pytest.raises(ValueError, match="holds a checkpoint at step 9"):
    check_workdir(config, URL)


def _tiny_config(steps):
  c = arith_tiny.get_config()
  c.admission.quotas = {"arith": 8}
  c.admission.minibatches = 2
  c.rollout.group_size = 4
  c.loop.steps = steps
  c.loop.log_every = 1
  c.checkpoint.every_steps = 1
  return c


def test_colocated_run_writes_to_the_bucket_and_resumes_from_it(bucket):
  steps_seen = []
  train(from_config_dict(_tiny_config(2)), URL, on_step=lambda s, m: steps_seen.append(s))
  assert sorted(p.name for p in (bucket / "checkpoints").iterdir()) == ["1", "2"]
  assert [r["step"] for r in read_metrics(URL)] == [1, 2]
  assert (bucket / "reward.png").exists()
  assert any((bucket / "tb").iterdir())

  train(from_config_dict(_tiny_config(3)), URL, on_step=lambda s, m: steps_seen.append(s))
  assert steps_seen == [1, 2, 3]  # the second run resumed after step 2
  rows = read_metrics(URL)
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert [r["version"] for r in rows] == [2, 4, 6]
  assert sorted(p.name for p in (bucket / "checkpoints").iterdir()) == ["2", "3"]
