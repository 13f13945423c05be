"""Kill a Ray storage unit and a Ray rollout actor in the middle of a disaggregated run.

The run (`configs/arith_disagg.py:quick` with two Ray rollout actors, each writing into a storage
unit on its node, on a local cluster) must finish every step with exact quotas per step and
mini-batch, lose no group, consume none twice and start none deeper ahead of the trainer than
``pipeline.max_lag_steps`` allows, across the replacement (`kill_resume.check_disaggregated`);
the rollout actor is replaced (its groups generated again) and the storage unit restarted by Ray
(its groups replayed from its spill folder).
"""

from __future__ import annotations

import os
import signal
import time

from lab.faults.kill_resume import _config, _jsonl, actor_pids, check_disaggregated, staleness

RUN = (
  "configs/arith_disagg.py",
  "quick",
  {"loop.steps": 4, "checkpoint.every_steps": 1, "topology.rollout_workers": 2},
)


def run(workdir: str, *, kill_after_step: int = 1, log=print) -> dict:
  """One run with both kills after train step ``kill_after_step``; returns what held."""
  import ray

  from knitjax.config import from_config_dict
  from knitjax.run import train

  config = from_config_dict(_config(RUN))
  killed: dict[str, int] = {}

  def on_step(step: int, metrics: dict) -> None:
    if step == kill_after_step and not killed:
      for kind in ("_StorageActor", "_RolloutActor"):
        pids = actor_pids(kind)
        if pids:
          os.kill(pids[0], signal.SIGKILL)
          killed[kind] = pids[0]
      log(f"[actor-loss] after step {step}: killed {killed}")

  t0 = time.time()
  error = None
  try:
    last = train(config, workdir, on_step=on_step)
  except Exception as e:  # the suite reports what went wrong instead of dying
    error, last = f"{type(e).__name__}: {e}", {}
  finally:
    if ray.is_initialized():
      ray.shutdown()
  problems = [] if error is None else [error]
  if error is None:
    problems += check_disaggregated(workdir, config.loop.steps, RUN)
  kinds = {"storage_unit": "_StorageActor" in killed, "rollout_actor": "_RolloutActor" in killed}
  for kind, was_killed in kinds.items():
    if not was_killed:
      problems.append(f"no {kind} process was found to kill")
  out = {
    "killed": killed,
    "survived": {k: v and not problems for k, v in kinds.items()},
    "actor_restarts": last.get("actor_restarts"),
    "groups_regenerated": last.get("groups_regenerated"),
    **staleness(_jsonl(os.path.join(workdir, "consumed.jsonl"))),
    "problems": problems,
    "seconds": time.time() - t0,
  }
  log(f"[actor-loss] {out}")
  return out
