"""Weight sync across two processes (jax.experimental.transfer), as two real CPU processes.

The trainer process (4 fake devices, an FSDP mesh) stages two versions in bfloat16; the rollout
process (2 fake devices, a data-parallel mesh) pulls both straight into its own shardings. The
trainer counts host reads of its arrays while staging (none), the rollout saves what it got.
"""

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> (logical axes, shape): an embedding, attention and MLP matrices, a norm scale.
LEAVES = {
  "embed": (("vocab", "embed"), (64, 32)),
  "q": (("embed", "heads", "head_dim"), (32, 4, 8)),
  "gate": (("embed", "mlp"), (32, 64)),
  "norm": (("norm",), (32,)),
}

PEER = textwrap.dedent(
  """
  import os, sys, time
  role, folder = sys.argv[1], sys.argv[2]
  devices = "4" if role == "train" else "2"
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=" + devices
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax, jax.numpy as jnp, numpy as np
  from jax._src import array as jax_array
  from knitjax import sharding
  from knitjax.runtime.weight_transfer import WeightClient, WeightServer
  from tests.runtime.test_weight_transfer import LEAVES, values

  rollout_shape = {"data": 2, "fsdp": 1, "tensor": 1}
  if role == "train":
    mesh = sharding.make_mesh((1, 4, 1))
    specs = {k: sharding.logical_to_spec(a) for k, (a, s) in LEAVES.items()}
    server = WeightServer(mesh, specs, rollout_shape, sync_dtype="bfloat16", address="127.0.0.1:0")
    reads = []
    value = jax_array.ArrayImpl._value
    jax_array.ArrayImpl._value = property(lambda self: reads.append(1) or value.fget(self))
    for version in (1, 2):
      params = {
        k: jax.device_put(v, sharding.logical_sharding(mesh, LEAVES[k][0], v.shape))
        for k, v in values(version).items()
      }
      server.stage(params, version)
    print("host reads while staging:", len(reads), flush=True)
    with open(os.path.join(folder, "address.tmp"), "w") as f:
      f.write(server.address)
    os.rename(os.path.join(folder, "address.tmp"), os.path.join(folder, "address"))
    while not os.path.exists(os.path.join(folder, "done")):
      time.sleep(0.05)
  else:
    mesh = sharding.make_mesh((-1, 1, 1))
    abstract = {
      k: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding.logical_sharding(mesh, a, s))
      for k, (a, s) in LEAVES.items()
    }
    path = os.path.join(folder, "address")
    while not os.path.exists(path):
      time.sleep(0.05)
    client = WeightClient(open(path).read(), abstract, address="127.0.0.1:0")
    for version in (2, 1):
      got = client.pull(version)
      for k, x in got.items():
        assert x.sharding == abstract[k].sharding and x.dtype == jnp.bfloat16, (k, x.sharding)
        np.save(os.path.join(folder, f"v{version}_{k}.npy"), np.asarray(x).astype(np.float32))
    open(os.path.join(folder, "done"), "w").close()
  print(role, "finished", flush=True)
  """
)


def values(version: int) -> dict:
  """The float32 params of ``version`` (the same in every process)."""
  rng = np.random.default_rng(version)
  return {k: rng.normal(size=s).astype(np.float32) for k, (_, s) in LEAVES.items()}


def _transfer_available() -> bool:
  try:
    from jax.experimental import transfer
  except ImportError:
    return False
  return hasattr(transfer, "start_transfer_server")


@pytest.mark.skipif(not _transfer_available(), reason="this JAX has no jax.experimental.transfer")
def test_rollout_process_pulls_bf16_versions_from_the_trainer_process(tmp_path):
  env = {**os.environ, "PYTHONPATH": REPO}
  procs, logs = [], []
  for role in ("train", "rollout"):
    logs.append(tmp_path / f"{role}.log")
    with open(logs[-1], "w") as log:
      procs.append(
        subprocess.Popen(
          [sys.executable, "-c", PEER, role, str(tmp_path)],
          cwd=REPO,
          env=env,
          stdout=log,
          stderr=subprocess.STDOUT,
        )
      )
  try:
    codes = [p.wait(timeout=120) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  out = [f.read_text() for f in logs]
  assert codes == [0, 0], f"exit codes {codes}\n{out[0][-3000:]}\n---\n{out[1][-3000:]}"
  assert "host reads while staging: 0" in out[0]
  for version in (1, 2):
    for k, want in values(version).items():
      got = np.load(tmp_path / f"v{version}_{k}.npy")
      np.testing.assert_array_equal(got, want.astype(jnp.bfloat16).astype(np.float32))
