"""A disaggregated trainer spread over two processes (`knitjax.distributed.trainer_processes`).

Two trainer processes (``--distributed``, 2 fake CPU devices each, one FSDP mesh over all 4) and
a Ray rollout actor run ``configs/arith_disagg.py:quick``. Process 0 holds the one admission
index and announces every released mini-batch with its consumer plan; each process fetches only
its share and publishes only its own shards of each version. The run must keep every invariant
of a one-process disaggregated run (versions, quotas, conservation), both processes must hear
the same plans and end on the same step, version and parameters, and those parameters must
equal a one-process trainer's fed the same train batches (replayed from the processes' shards).
"""

import glob
import json
import os
import re

import jax
import numpy as np
import pytest
from flax import nnx

from configs import arith_disagg
from knitjax.config import from_config_dict
from knitjax.distributed.weight_parts import wire_format_of
from knitjax.runtime import builder
from knitjax.train.checkpoint import Checkpointer
from knitjax.train.step import batch_shardings
from lab import local_processes
from tests import tiny
from tests.runtime.test_disaggregated import check_run, read_jsonl
from tests.runtime.test_multihost_main import _gloo_available

pytest.importorskip("ray")
pytestmark = pytest.mark.skipif(not _gloo_available(), reason="jaxlib without gloo collectives")

STEPS = 3
OVERRIDES = {
  "loop.steps": STEPS,
  "loop.log_every": 1,
  "mesh.cpu_devices": 2,
  "mesh.shape": "(1,-1,1)",  # FSDP across both processes: each holds half of most leaves
  "topology.rollout_workers": 1,  # one actor: four JAX processes on 2 cores, not five
}


def _config():
  c = arith_disagg.get_config("quick")
  tiny.set_fields(c, steps=STEPS, log_every=1, rollout_workers=1)
  c.mesh.update(cpu_devices=2, shape=(1, -1, 1))
  return c


def _summary(stderr: str, k: int) -> dict:
  found = re.findall(rf"process {k} of 2 finished: (\{{.*\}})", stderr)
  assert len(found) == 1, stderr[-3000:]
  return json.loads(found[0])


def _replay_batch(folder: str, step: int, index: int) -> dict[str, np.ndarray]:
  """The global train batch of mini-batch (step, index), from both processes' shards."""
  out: dict[str, np.ndarray] = {}
  for path in sorted(glob.glob(os.path.join(folder, f"{step}-{index}.p*.npz"))):
    with np.load(path) as z:
      for name in z.files:
        key, n, what = name.split("|") if name.count("|") == 2 else (*name.split("|"), "")
        if n == "shape":
          continue
        if what == "data":
          shape = tuple(z[f"{key}|shape"])
          target = out.setdefault(key, np.zeros(shape, z[name].dtype))
          where = tuple(slice(a, b) for a, b in z[f"{key}|{n}|index"])
          target[where] = z[name]
  return out


def test_two_trainer_processes_share_one_admission_index(tmp_path):
  workdir, dumps = str(tmp_path / "run"), str(tmp_path / "batches")
  args = ["--config=configs/arith_disagg.py:quick"] + [
    f"--config.{k}={v}" for k, v in OVERRIDES.items()
  ]
  args.append(f"--dump_batches={dumps}")
  result = local_processes.launch(args, workdir, [{}] * 2, timeout=600, module="lab.batch_dump")
  assert [code for code, _ in result] == [0, 0], [err[-3000:] for _, err in result]
  s0, s1 = (_summary(err, k) for k, (_, err) in enumerate(result))
  for key in ("step", "version", "loss", "param_norm"):
    assert s0[key] == s1[key], (key, s0, s1)
  config = _config()
  cfg = from_config_dict(config)
  check_run(workdir, config)  # versions, quotas per step and mini-batch, conservation by id

  # The same plan on both processes, mini-batch by mini-batch; each fetched exactly its part.
  consumed = read_jsonl(workdir, "consumed.jsonl")
  logs = [read_jsonl(workdir, f"fetched.p{k}.jsonl") for k in (0, 1)]
  assert len(logs[0]) == len(logs[1]) == len(consumed) == STEPS * cfg.admission.minibatches
  for c, r0, r1 in zip(consumed, *logs, strict=True):
    assert (r0["step"], r0["index"]) == (r1["step"], r1["index"]) == (c["step"], c["index"])
    assert r0["plan"] == r1["plan"]
    assert r0["fetched"] == r0["plan"][0] and r1["fetched"] == r1["plan"][1]
    assert sorted(r0["fetched"] + r1["fetched"]) == sorted(c["group_ids"])
    assert not set(r0["fetched"]) & set(r1["fetched"])
    assert r0["bytes"] > 0 and r1["bytes"] > 0  # each its share, never the whole mini-batch

  # A one-process trainer on 4 devices of this process, same mesh and init, fed the same
  # global batches (reassembled from both processes' shards), ends with the same parameters.
  devices = jax.devices()[:4]
  mesh = builder.build_mesh(cfg, devices=devices)
  _, learner = builder.build_learner(cfg, mesh, str(tmp_path / "reference"))
  # Weights leave as each process's own shards only: together every value once, and neither
  # process sends the whole parameter set (no host gather).
  wire_format, _ = wire_format_of(nnx.to_pure_dict(learner.state.params))
  wire = wire_format.nbytes
  assert s0["weight_publish_bytes"] + s1["weight_publish_bytes"] == wire
  assert 0 < s1["weight_publish_bytes"] < wire and 0 < s0["weight_publish_bytes"] < wire
  shardings = batch_shardings(mesh, packed=False)
  with jax.set_mesh(mesh):
    for c in consumed:
      batch = _replay_batch(dumps, c["step"], c["index"])
      batch = jax.device_put(batch, {k: shardings[k] for k in batch})
      learner.state, _ = learner._update(learner.state, batch)
  ckpt = Checkpointer(workdir)
  restored, _ = ckpt.restore(learner.state)
  ckpt.close()
  got = jax.tree.leaves(jax.device_get(restored.params))
  want = jax.tree.leaves(jax.device_get(learner.state.params))
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  learner.close()
