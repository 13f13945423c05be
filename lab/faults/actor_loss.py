"""Kill a Ray storage unit and a Ray rollout actor in the middle of a disaggregated run.

The run (`configs/arith_disagg.py:quick` with two Ray rollout actors, each writing into a storage
unit on its node, on a local cluster) must finish every step with exact quotas, lose no group
and consume none twice; the rollout actor is replaced (its groups generated again) and the storage
unit restarted by Ray (its groups replayed from its spill folder).
"""

from __future__ import annotations

import os
import signal
import time

from lab.faults.kill_resume import _config, actor_pids, check_disaggregated

RUN = ("configs/arith_disagg.py", "quick", {"loop.steps": 4, "checkpoint.every_steps": 1})


def run(workdir: str, *, kill_after_step: int = 1, log=print) -> dict:
  """One run with both kills after train step ``kill_after_step``; returns what held."""
  import ray

  from knitjax.config import from_config_dict
  from knitjax.run import train

  c = _config(RUN)
  c.topology.rollout_workers = 2
  config = from_config_dict(c)
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
    problems += check_disaggregated(workdir, config.loop.steps)
  kinds = {"storage_unit": "_StorageActor" in killed, "rollout_actor": "_RolloutActor" in killed}
  for kind, was_killed in kinds.items():
    if not was_killed:
      problems.append(f"no {kind} process was found to kill")
  out = {
    "killed": killed,
    "survived": {k: v and not problems for k, v in kinds.items()},
    "actor_restarts": last.get("actor_restarts"),
    "groups_regenerated": last.get("groups_regenerated"),
    "problems": problems,
    "seconds": time.time() - t0,
  }
  log(f"[actor-loss] {out}")
  return out
