"""Two real JAX processes (CPU, gloo collectives) as two trainer hosts: each consumer fetches
only its own groups from its own storage unit, the global batch is assembled from both parts
(``jax.make_array_from_process_local_data``), and the update equals the whole mini-batch's
update computed in one process."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np

from lab import without_device_count

# The shared part: the model, the groups and the step, identical in every process.
COMMON = textwrap.dedent(
  """
  import numpy as np
  import optax
  from flax import nnx

  from knitjax import sharding
  from knitjax.models.transformer import Transformer, TransformerConfig
  from knitjax.train import losses
  from knitjax.train.step import StepHParams, compile_train_step, init_train_state
  from knitjax.transfer.access import RowSpec
  from knitjax.transfer.admission import MiniBatch
  from knitjax.transfer.group import GroupMeta
  from knitjax.transfer.payload import synthetic_payload
  from knitjax.transfer.storage import InProcessStorageUnit, StorageLimits

  CFG = TransformerConfig(
    vocab_size=32, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn_dim=32
  )
  P_LEN, N_NEW, G, GROUPS, K = 4, 5, 2, 8, 2
  ROW_SPEC = RowSpec(estimator="grpo", prompt_len=P_LEN, max_new_tokens=N_NEW, pad_id=0)
  LIMITS = StorageLimits(vocab_size=32, max_seq_len=P_LEN + N_NEW, max_bytes=1 << 20)

  def groups():
    rng = np.random.default_rng(0)
    out = []
    for gid in range(GROUPS):
      payload = synthetic_payload(
        rng, group_size=G, prompt_len=P_LEN, response_len=N_NEW, vocab_size=32
      )
      lens = payload["response_lengths"]
      meta = GroupMeta(
        group_id=gid, cls="a", gen_version=0, num_samples=G, prompt_tokens=(P_LEN,) * G,
        response_tokens=tuple(int(x) for x in lens), storage_unit=gid % 2,
      )
      out.append((meta, payload))
    return out

  def step_fn(mesh):
    graphdef, params = sharding.init_sharded(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), mesh)
    state, shardings = init_train_state(params, optax.sgd(1.0), mesh)
    step = compile_train_step(
      graphdef=graphdef, optimizer=optax.sgd(1.0),
      hparams=StepHParams(loss=losses.LossConfig(), max_new_tokens=N_NEW),
      state_shardings=shardings, mesh=mesh,
    )
    return state, step
  """
)

WORKER = textwrap.dedent(
  """
  import json, os, sys
  pid, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=2"
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
  exec(open(sys.argv[4]).read())
  from knitjax.train.batch import split_micro_batches
  from knitjax.train.step import batch_shardings, host_metrics
  from knitjax.transfer.access import consumer_batch, to_global

  # This host's storage unit holds the groups its rollout workers wrote (unit id = process id).
  unit = InProcessStorageUnit(LIMITS, unit_id=pid)
  metas = []
  for meta, payload in groups():
    metas.append(meta)
    if meta.storage_unit == pid:
      unit.put(meta.group_id, payload)
  mb = MiniBatch(0, 0, tuple(metas))
  # Only the local unit is reachable: a remote read would be a KeyError here.
  local, info = consumer_batch(
    mb, {pid: unit}, row_spec=ROW_SPEC, consumer=jax.process_index(),
    num_consumers=jax.process_count(), locality_slack=1e9,
  )
  mesh = sharding.make_mesh((-1, 1, 1))
  state, step = step_fn(mesh)
  batch = to_global(split_micro_batches(local, K), batch_shardings(mesh))
  with jax.set_mesh(mesh):
    state, m = step(state, batch)
  params = {
    "/".join(map(str, path)): np.asarray(x.addressable_shards[0].data).tolist()
    for path, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
  }
  with open(out, "w") as f:
    json.dump({
      "loss": float(host_metrics(m)["loss"]),
      "rows": int(len(local["advantages"])),
      "local_fraction": info["local_fraction"],
      "global_rows": int(batch["advantages"].shape[1]),
      "params": params,
    }, f)
  jax.distributed.shutdown()
  """
)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_process_consumers_match_the_single_process_update(tmp_path):
  common = tmp_path / "common.py"
  common.write_text(COMMON)
  worker = tmp_path / "worker.py"
  worker.write_text(WORKER)
  port = str(_free_port())
  env = without_device_count(os.environ)  # the worker sets its own count
  env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
  procs = [
    subprocess.Popen(
      [sys.executable, str(worker), str(pid), port, str(tmp_path / f"out{pid}.json"), str(common)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for pid in (0, 1)
  ]
  for p in procs:
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out[-3000:]
  results = [json.loads((tmp_path / f"out{pid}.json").read_text()) for pid in (0, 1)]
  for r in results:
    assert r["rows"] == 8 and r["local_fraction"] == 1.0  # 4 local groups x G=2 per host
    assert r["global_rows"] == 8  # K=2 micro-batches of 8 rows: both hosts' parts

  # Reference: the whole mini-batch fetched in one place, one process, one device.
  ns = {}
  exec(COMMON, ns)
  from knitjax import sharding
  from knitjax.train.batch import split_micro_batches
  from knitjax.train.step import batch_shardings, host_metrics
  from knitjax.transfer.access import fetch_minibatch

  unit = ns["InProcessStorageUnit"](ns["LIMITS"])
  metas = []
  for meta, payload in ns["groups"]():
    unit.put(meta.group_id, payload)
    metas.append(meta.__class__(**{**meta.__dict__, "storage_unit": 0}))
  whole, _ = fetch_minibatch(ns["MiniBatch"](0, 0, tuple(metas)), {0: unit}, ns["ROW_SPEC"])
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  state, step = ns["step_fn"](mesh)
  batch = jax.device_put(split_micro_batches(whole, ns["K"]), batch_shardings(mesh))
  with jax.set_mesh(mesh):
    state, m = step(state, batch)
  expected = {
    "/".join(map(str, path)): np.asarray(x)
    for path, x in jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
  }
  for r in results:
    np.testing.assert_allclose(r["loss"], float(host_metrics(m)["loss"]), rtol=1e-5)
    assert r["params"].keys() == expected.keys()
    for k, v in expected.items():
      np.testing.assert_allclose(np.asarray(r["params"][k]), v, rtol=1e-4, atol=1e-6, err_msg=k)
