"""Where a run's parts run: one topology, chosen once from the config's topology section.

A topology (the `knitjax.runtime.loop.Topology` protocol, declared by the loops that use it)
hands the run loops (`knitjax.runtime.colocated`, `knitjax.runtime.disaggregated`) what depends
on where things run, and nothing else does:

- ``split``: which of this process's devices generate and which train;
- ``rollout``: the rollout and the storage units it writes to (None in a process without one);
- ``pipe``: a disaggregated run's `knitjax.runtime.loop.Pipe`, with the weight publisher that
  reaches that rollout.

The topologies, in the order `choose` tries them:

- `TrainerProcesses` (`trainer_processes`): ``--distributed`` with several processes, and
  ``topology.mode="disaggregated"``;
- `RayWorkers` (`ray_workers`): ``topology.rollout_workers > 0``;
- `InProcess` (`in_process`): otherwise (storage units in this process or in Ray actors).

Adding one is a new module implementing `Topology` and one line in `choose`.
"""

from __future__ import annotations

import jax

from knitjax.config import Config
from knitjax.runtime.loop import Topology


def choose(config: Config, *, workdir: str = "") -> Topology:
  """The topology ``config.topology`` (with ``jax.process_count()``) describes.

  ``workdir``: the run's; a local Ray started for it authenticates with a token kept there
  (`knitjax.distributed.local_ray`). Empty: the user's Ray token.
  """
  t = config.topology
  if jax.process_count() > 1 and t.mode == "disaggregated":
    from knitjax.distributed.trainer_processes import TrainerProcesses

    return TrainerProcesses(config, workdir=workdir)
  if t.rollout_workers:
    from knitjax.distributed.ray_workers import RayWorkers

    return RayWorkers(config, workdir=workdir)
  from knitjax.distributed.in_process import InProcess

  return InProcess(config, workdir=workdir)
