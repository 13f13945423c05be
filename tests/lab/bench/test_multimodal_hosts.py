"""The pure parts of the trainer-hosts multimodal bench (lab/bench/multimodal_hosts.py): which host
runs what on which cores, each host's share of a step, the dilation per host, and how the T
processes' timings become one mini-batch's."""

import os
import sys

import pytest

from lab.bench import multimodal_hosts as mmh
from lab.cluster import net, scale

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)
from configs.bench import cluster as cluster_config  # noqa: E402
from configs.bench import multimodal as mm_config  # noqa: E402


def test_trainers_share_one_core_and_storage_and_controller_the_other():
  cores = mmh.host_cores(4, (0,), (1,))
  assert cores == [(0,), (1,), (1,), (0,), (0,), (0,)]
  assert mmh.trainer_hosts(1) == [0]
  assert mmh.trainer_hosts(4) == [0, 3, 4, 5]
  assert {cores[h] for h in mmh.trainer_hosts(4)} == {(0,)}
  assert mmh.core_share(4)["core_fraction_per_trainer_host"] == 0.25
  assert mmh.core_share(2, (0, 1))["core_fraction_per_trainer_host"] == 1.0
  with pytest.raises(ValueError, match="trainer_hosts must be >= 1"):
    mmh.host_cores(0)


def test_each_host_trains_the_one_host_step_weak_scaling():
  c = mm_config.get_config("cluster")
  for t in (1, 2, 4):
    w = mmh.hosts_workload(c, t)
    assert w.groups_per_step == 4 * t
    assert mmh.rows_per_host(w, t) == 4 * 8  # 4 groups of G = 8, whatever T
    assert w.groups_per_minibatch % t == 0  # every host has its own groups in each mini-batch
    assert w.release == "step_start" and w.row_format == "float32"


def test_the_dilation_is_per_host_compute_per_row():
  real = scale.RealWorkload(**dict(cluster_config.get_config().real))
  one = mmh.per_host_dilation(real, 2.4, 32)  # one host alone: 75 ms a row
  four = mmh.per_host_dilation(real, 4 * 2.4, 32)  # four hosts on one core: 4x the seconds
  assert one["emulated_naive_s_per_row"] == pytest.approx(0.075)
  assert four["factor"] == pytest.approx(4 * one["factor"])
  assert four["link_mbit"] == pytest.approx(one["link_mbit"] / 4)
  assert one["link_mbit"] == pytest.approx(25_000 / one["factor"])


def _row(exposed, compute, unique=2.0, transfer=None):
  return {
    "transfer_s": exposed if transfer is None else transfer,
    "exposed_s": exposed,
    "compute_s": compute,
    "release_to_compute_s": exposed,
    "groups": [0, 1],
    "unique_images": unique,
    "num_seqs": 16.0,
    "encoder_images_encoded": 2.0,
    "encoder_backward_passes": 1.0,
  }


def test_a_minibatch_waits_for_its_slowest_host():
  # host 0 had its data at once and then waited in the step's collectives for host 1
  p0 = [_row(0.0, 1.5), _row(0.1, 1.0)]
  p1 = [_row(0.5, 1.0), _row(0.0, 1.0)]
  a, b = mmh.combine([p0, p1])
  assert a["exposed_s"] == 0.5 and a["compute_s"] == pytest.approx(1.0)
  assert b["exposed_s"] == 0.1 and b["compute_s"] == pytest.approx(1.0)
  assert a["unique_images"] == 4.0 and a["num_seqs"] == 16.0  # the step counts all hosts' rows
  with pytest.raises(ValueError):
    mmh.combine([p0, p1[:1]])


def test_configs_name_the_trainer_hosts_and_quick_skips_them():
  full, quick = cluster_config.get_config(), cluster_config.get_config("quick")
  assert tuple(full.trainer_hosts) == (1, 2, 4) and full.trainer_host_rounds >= 2
  assert full.one_trainer_host
  assert tuple(quick.trainer_hosts) == ()


def test_a_phase_figures_compare_the_slowest_hosts_and_count_every_group():
  c = mm_config.get_config("cluster")
  w = mmh.hosts_workload(c, 2)  # 8 groups a step, 2 mini-batches of 4 groups, 2 per host

  def rows(exposed, compute):
    return [
      {**_row(e, compute), "groups": [4 * j + g for g in range(4)], "num_seqs": 32.0}
      for j, e in enumerate(exposed)
    ]

  groups = {m: [[[0, 1, 2, 3], [4, 5, 6, 7]]] for m in mmh.MODES}
  sizes = [{"received": {"0": 10.0, "1": 10.0}, "sent": {"0": 40.0, "1": 40.0}}]
  per = [
    {"rows": {"centralized": rows([2.0, 0.0], 3.0), "on_demand": rows([0.1, 0.0], 2.0)},
     "sizes": sizes, "bytes": 5.0},
    {"rows": {"centralized": rows([1.0, 0.0], 3.0), "on_demand": rows([0.2, 0.0], 2.0)},
     "sizes": sizes, "bytes": 7.0},
  ]  # fmt: skip
  f = mmh.figures(w, 1, per, groups)
  assert f["centralized"]["step_s"] == pytest.approx(2.0 + 6.0)  # host 0's wait, both computes
  assert f["on_demand"]["step_s"] == pytest.approx(0.2 + 4.0)
  assert f["speedup"] == pytest.approx(8.0 / 4.2)
  assert f["latency_ratio"] == pytest.approx(2.0 / 0.2)
  assert f["centralized"]["bytes"] == 100.0 and f["on_demand"]["bytes"] == 12.0
  assert f["on_demand"]["counts"] == {"groups": 8, "rows": 64, "lost": 0, "duplicated": 0}
  groups["on_demand"] = [[[0, 1, 2, 3], [4, 5, 6, 6]]]
  with pytest.raises(RuntimeError, match="lost or duplicated"):
    mmh.figures(w, 1, per, groups)


_GLOO = """
import os, sys
from lab.bench.multimodal_hosts import _own_hostname
k, coordinator, address = int(sys.argv[1]), sys.argv[2], sys.argv[3]
_own_hostname(address)
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
import jax, numpy as np
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator, num_processes=2, process_id=k)
from jax.experimental import multihost_utils
print("sum", float(multihost_utils.process_allgather(np.array([k + 1.0])).sum()), flush=True)
"""


MISSING = net.cannot_build()


@pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
def test_two_trainer_hosts_are_one_jax_program_over_gloo():
  """Each process in its own namespace, named after its host's address: gloo connects them
  across the hosts' links (without the name, it binds to 127.0.0.1 and never connects)."""
  import subprocess

  from lab.cluster.hosts import Cluster, HostSpec

  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  with Cluster([HostSpec(cores=(0,)), HostSpec(cores=(1,))], log=lambda m: None) as cluster:
    coordinator = f"{cluster.hosts[0].address}:{mmh.PORT}"
    procs = [
      cluster.spawn(
        k,
        [sys.executable, "-c", _GLOO, str(k), coordinator, cluster.hosts[k].address],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
      )
      for k in range(2)
    ]
    outs = [p.communicate(timeout=60)[0].decode(errors="replace") for p in procs]
  for p, out in zip(procs, outs, strict=True):
    assert p.returncode == 0, out[-1500:]
    assert "sum 3.0" in out
