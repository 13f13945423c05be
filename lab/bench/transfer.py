"""Trajectory transfer: on-demand access vs a central gather-and-scatter, and prefetch overlap.

Part 1 (counted on the real storage units, consumer planner and layout code): ``hosts`` trainer
hosts, each with a storage unit; every mini-batch's groups were written to the units of the
hosts whose rollout workers generated them (uniformly at random). Three ways to get each
consumer its rows:

- ``centralized``: a controller (its own node) gathers the whole mini-batch from every unit and
  scatters each consumer's rows to it: every byte crosses the network twice and all of them pass
  through the controller.
- ``hash_placement``: payloads placed over the units by group-id hash (no controller), and each
  consumer takes a contiguous share of the mini-batch's groups without regard to where they
  live, reading them from every unit: about ``1 - 1/hosts`` of the bytes cross hosts.
- ``on_demand`` (knitjax): the consumer plan sends each group to the consumer on its unit's
  host when counts and the token slack allow; each consumer fetches exactly its groups.

Per mode: bytes that cross hosts, bytes through the busiest endpoint (what bounds the transfer
time when links are equal), requests, and the host CPU seconds of the code path (in one process
here, so no network time: the byte counts are the portable result).

Part 2 (measured in real disaggregated runs, ``real.enabled``): the exposed fetch latency (the
part of fetching the trainer waited for) with ``pipeline.prefetch`` 0 and 1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import time

import numpy as np

from knitjax.distributed.topology import choose
from knitjax.transfer.access import RowSpec, consumer_batch, fetch_minibatch
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.consumer import ConsumerPlan, plan_consumers
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.payload import GroupPayload, synthetic_payload
from knitjax.transfer.storage import InProcessStorageUnit, StorageLimits
from lab.bench.report import format_table, write_json

MODES = ("centralized", "hash_placement", "on_demand")


def _hash_unit(group_id: int, hosts: int) -> int:
  return int(hashlib.sha256(str(group_id).encode()).hexdigest(), 16) % hosts


def _count(mode: str, plan, unit_of: dict[int, int], nbytes: dict[int, int], hosts: int) -> dict:
  """Bytes across hosts, per-endpoint bytes and requests of one mini-batch's transfer."""
  endpoint = np.zeros(hosts + 1)  # the last endpoint is the controller
  cross = requests = 0
  for c, groups in enumerate(plan.groups):
    for g in groups:
      b, unit = nbytes[g.group_id], unit_of[g.group_id]
      if mode == "centralized":  # unit -> controller -> consumer
        cross += 2 * b
        endpoint[unit] += b
        endpoint[hosts] += 2 * b
        endpoint[c] += b
      elif unit != c:  # direct read of a remote unit
        cross += b
        endpoint[unit] += b
        endpoint[c] += b
    units = {unit_of[g.group_id] for g in groups}
    requests += len(units) + (mode == "centralized")
  return {
    "cross_host_bytes": cross,
    "busiest_endpoint_bytes": float(endpoint.max()),
    "requests": requests,
  }


def run(config, workdir: str) -> dict:
  w = config.workload
  os.makedirs(workdir, exist_ok=True)
  rng = np.random.default_rng(config.seed)
  limits = StorageLimits(
    vocab_size=w.vocab_size, max_seq_len=w.prompt_len + w.response_len, max_bytes=1 << 40
  )
  row_spec = RowSpec(
    estimator="grpo", prompt_len=w.prompt_len, max_new_tokens=w.response_len, pad_id=0
  )
  totals = {m: {"cross_host_bytes": 0, "busiest_endpoint_bytes": 0.0, "requests": 0} for m in MODES}
  cpu_s = {m: [] for m in MODES}
  local_fraction, total_bytes, gid = [], 0, 0
  for i in range(w.minibatches):
    units = {
      mode: {h: InProcessStorageUnit(limits, unit_id=h) for h in range(w.hosts)}
      for mode in ("rollout_host", "hash")
    }
    metas, unit_of, hash_of, nbytes = [], {}, {}, {}
    for _ in range(w.groups_per_minibatch):
      p = synthetic_payload(
        rng,
        group_size=w.group_size,
        prompt_len=w.prompt_len,
        response_len=w.response_len,
        vocab_size=w.vocab_size,
        min_response=w.response_len // 4,
      )
      unit_of[gid] = int(rng.integers(w.hosts))  # the host whose rollout worker generated it
      hash_of[gid] = _hash_unit(gid, w.hosts)
      units["rollout_host"][unit_of[gid]].put(gid, p)
      units["hash"][hash_of[gid]].put(gid, p)
      nbytes[gid] = units["hash"][hash_of[gid]].get([gid])[0].nbytes  # the stored payload
      total_bytes += nbytes[gid]
      lens = tuple(int(x) for x in p["response_lengths"])
      metas.append(
        GroupMeta(
          group_id=gid,
          cls="a",
          gen_version=0,
          num_samples=w.group_size,
          prompt_tokens=(w.prompt_len,) * w.group_size,
          response_tokens=lens,
          storage_unit=unit_of[gid],
        )
      )
      gid += 1
    mb = MiniBatch(0, i, tuple(metas))
    hashed = MiniBatch(0, i, tuple(_replace_unit(m, hash_of[m.group_id]) for m in metas))
    plan = plan_consumers(mb, w.hosts, locality_slack=w.locality_slack)
    local_fraction.append(plan.stats()["local_fraction"])
    for mode, the_mb, the_units, the_unit_of in (
      ("centralized", mb, units["rollout_host"], unit_of),
      ("hash_placement", hashed, units["hash"], hash_of),
      ("on_demand", mb, units["rollout_host"], unit_of),
    ):
      if mode == "on_demand":
        the_plan = plan_consumers(the_mb, w.hosts, locality_slack=w.locality_slack)
      else:  # placement-agnostic: consumer c takes the c-th contiguous share of the groups
        the_plan = _contiguous_plan(the_mb, w.hosts)
      counted = _count(mode, the_plan, the_unit_of, nbytes, w.hosts)
      for k, v in counted.items():
        totals[mode][k] += v
      t = time.perf_counter()
      if mode == "centralized":  # gather everything in one place, then cut out each part
        whole, _ = fetch_minibatch(the_mb, the_units, row_spec)
        rows = len(whole["advantages"]) // w.hosts
        parts = [
          {k: v[c * rows : (c + 1) * rows].copy() for k, v in whole.items()} for c in range(w.hosts)
        ]
      elif mode == "hash_placement":
        parts = [
          fetch_minibatch(the_plan.minibatch_for(c), the_units, row_spec)[0] for c in range(w.hosts)
        ]
      else:
        parts = [
          consumer_batch(
            the_mb,
            the_units,
            row_spec=row_spec,
            consumer=c,
            num_consumers=w.hosts,
            locality_slack=w.locality_slack,
          )[0]
          for c in range(w.hosts)
        ]
      cpu_s[mode].append(time.perf_counter() - t)
      assert sum(len(p["advantages"]) for p in parts) == w.groups_per_minibatch * w.group_size
  n = w.minibatches
  modes = {
    m: {
      "cross_host_bytes_per_minibatch": totals[m]["cross_host_bytes"] / n,
      "cross_host_fraction": totals[m]["cross_host_bytes"] / total_bytes,
      "busiest_endpoint_bytes_per_minibatch": totals[m]["busiest_endpoint_bytes"] / n,
      "requests_per_minibatch": totals[m]["requests"] / n,
      "cpu_s_per_minibatch": float(np.median(cpu_s[m])),
    }
    for m in MODES
  }
  base = modes["centralized"]["busiest_endpoint_bytes_per_minibatch"]
  for m in MODES:
    modes[m]["busiest_endpoint_reduction_vs_centralized"] = base / max(
      modes[m]["busiest_endpoint_bytes_per_minibatch"], 1.0
    )
  result = {
    "workload": {**w.to_dict(), "fields": [f.name for f in dataclasses.fields(GroupPayload)]},
    "minibatch_bytes": total_bytes / n,
    "on_demand_local_fraction": float(np.mean(local_fraction)),
    "modes": modes,
  }
  if config.real.enabled:
    result["prefetch"] = _real_runs(config, workdir)
  write_json(workdir, "transfer", result)
  _plot(result, os.path.join(workdir, "transfer.png"))
  rows = [{"mode": m, **v} for m, v in modes.items()]
  print(
    format_table(
      rows,
      [
        "mode",
        "cross_host_fraction",
        "busiest_endpoint_bytes_per_minibatch",
        "busiest_endpoint_reduction_vs_centralized",
        "requests_per_minibatch",
        "cpu_s_per_minibatch",
      ],
    )
  )
  if "prefetch" in result:
    print(format_table(result["prefetch"]["runs"], list(result["prefetch"]["runs"][0])))
  return result


def _contiguous_plan(mb: MiniBatch, consumers: int) -> ConsumerPlan:
  k = len(mb.groups) // consumers
  parts = tuple(mb.groups[c * k : (c + 1) * k] for c in range(consumers))
  home = tuple(sum(g.storage_unit == c for g in part) for c, part in enumerate(parts))
  return ConsumerPlan(mb.step, mb.index, parts, home)


def _replace_unit(meta: GroupMeta, unit: int) -> GroupMeta:
  return dataclasses.replace(meta, storage_unit=unit)


def _real_runs(config, workdir: str) -> dict:
  """Exposed fetch latency in real disaggregated runs, prefetch 0 vs 1 (same seed)."""
  from configs import arith_disagg
  from knitjax.config import from_config_dict
  from knitjax.runtime import disaggregated
  from knitjax.runtime.metrics import read_metrics

  runs = []
  for prefetch in (0, 1):
    c = arith_disagg.get_config("quick")
    c.loop.steps = config.real.steps
    c.loop.log_every = config.real.steps
    c.checkpoint.every_steps = 1000
    c.pipeline.prefetch = prefetch
    run_dir = os.path.join(workdir, f"prefetch{prefetch}")
    shutil.rmtree(run_dir, ignore_errors=True)
    config = from_config_dict(c)
    disaggregated.run(config, run_dir, choose(config))
    rows = read_metrics(run_dir)[config.real.skip_steps :]
    keys = ("data_wait_s", "exposed_fetch_s", "fetch_s", "release_to_compute_s", "step_s")
    runs.append({"prefetch": prefetch, **{k: float(np.mean([r[k] for r in rows])) for k in keys}})
  return {
    "config": "configs/arith_disagg.py:quick",
    "steps": config.real.steps,
    "skip_steps": config.real.skip_steps,
    "runs": runs,
    "exposed_fetch_hidden_fraction": 1.0
    - runs[1]["exposed_fetch_s"] / max(runs[0]["exposed_fetch_s"], 1e-12),
  }


def _plot(result: dict, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  modes = result["modes"]
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
  names = list(modes)
  mib = 2**20
  axes[0].bar(names, [modes[m]["cross_host_bytes_per_minibatch"] / mib for m in names])
  axes[0].set_ylabel("MiB across hosts / mini-batch")
  axes[1].bar(names, [modes[m]["busiest_endpoint_bytes_per_minibatch"] / mib for m in names])
  axes[1].set_ylabel("MiB through the busiest endpoint")
  w = result["workload"]
  fig.suptitle(
    f"{w['hosts']} hosts, {w['groups_per_minibatch']} groups x G={w['group_size']} per mini-batch"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
