"""A disaggregated trainer spread over processes: one admission index, every process told alike.

With ``jax.process_count() > 1`` the train mesh spans every process's devices and the rollout
runs in Ray actors. Process 0 (the *leader*) runs the rollout thread and the admission index,
as one process does. Each mini-batch it releases is planned over the consumers (one per
process, `knitjax.transfer.consumer`) and announced, mini-batch and plan together, through the
coordination service of JAX's distributed runtime (its key-value store) before the leader
fetches its own share. The other processes (*followers*) read the announcements in (step,
index) order, each fetches exactly the groups the plan gives it from their storage units (Ray
actors, reached by name), and all processes run the same update on the one global mesh.

A follower that hears nothing for ``PLAN_TIMEOUT_S`` stops with one sentence: it never trains
on a mini-batch the others do not. ``fetched.p<k>.jsonl`` records, per process and
mini-batch, the announced plan, the groups this process fetched and their payload bytes.

Every process publishes its own shards of each version (`knitjax.distributed.weight_shards`), and
watches the others' pulse in the same store (`knitjax.distributed.coordination.PulseWatch`): a lost
process ends the rest with one sentence, and a restart of all resumes from process 0's
checkpoint of the run state.

Nothing here opens a socket: the key-value store is the one JAX's runtime already holds open,
and payloads and weights move through Ray.
"""

from __future__ import annotations

import os
import time

import jax

from knitjax import records
from knitjax import workdir as wd
from knitjax.distributed.coordination import PulseWatch, announce, forget, hear
from knitjax.distributed.local_ray import ensure_ray
from knitjax.distributed.ray_workers import new_run_id, ray_rollout, shard_publisher
from knitjax.distributed.weight_shards import connect_board, create_board
from knitjax.runtime.builder import build_feed, build_preparer
from knitjax.runtime.learner import RunState
from knitjax.runtime.pipeline import Pipeline, publish_counters, publish_metrics
from knitjax.runtime.rollout_builder import build_storage_limits
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.consumer import ConsumerPlan, plan_consumers
from knitjax.transfer.feed import exposed_transfer

PLAN_TIMEOUT_S = 300.0  # a follower waits this long for the next plan before it gives up


def _plan_key(step: int, index: int) -> str:
  return f"plan/{step}/{index}"


class PlanBook:
  """The consumer plans of one process: announced (leader) or heard (follower), then used once.

  Args:
    workdir: the run's folder (``fetched.p<k>.jsonl`` goes there).
    minibatches: mini-batches per train step.
    start_step: the first train step this run consumes (a resumed run's).
    locality_slack: see :func:`knitjax.transfer.consumer.plan_consumers`.
    timeout_s: how long a follower waits for the next announcement.
  """

  def __init__(
    self,
    workdir: str,
    *,
    minibatches: int,
    start_step: int,
    locality_slack: float,
    timeout_s: float = PLAN_TIMEOUT_S,
  ):
    self.process, self.processes = jax.process_index(), jax.process_count()
    self._m, self._slack, self._timeout = minibatches, locality_slack, timeout_s
    self._next = (start_step, 0)  # the next (step, index) a follower expects
    self._plans: dict[tuple[int, int], ConsumerPlan] = {}  # announced or heard, not fetched
    self._used: dict[tuple[int, int], ConsumerPlan] = {}  # fetched, not yet recorded
    self._waited = 0.0
    name = f"fetched.p{self.process}.jsonl"
    path = wd.path(workdir, name)
    rows = wd.read_rows(path)
    self._log = wd.JsonlFile(path, [r for r in rows if r["step"] < start_step])

  @property
  def leader(self) -> bool:
    return self.process == 0

  def announce(self, mb: MiniBatch) -> None:
    """Leader: plans ``mb`` over the processes and announces mini-batch and plan together."""
    plan = plan_consumers(mb, self.processes, locality_slack=self._slack)
    value = {"minibatch": records.to_json(mb), "plan": records.to_json(plan)}
    announce(_plan_key(mb.step, mb.index), value)
    self._plans[(mb.step, mb.index)] = plan
    if mb.index == 0 and mb.step >= 2:  # every follower has fetched these long ago
      for j in range(self._m):
        forget(_plan_key(mb.step - 2, j))

  def take(self, timeout: float) -> MiniBatch | None:
    """Follower: the next announced mini-batch, waiting up to ``timeout`` (None: not yet).

    Raises:
      TimeoutError: nothing was announced for ``timeout_s`` in all (one sentence).
    """
    step, index = self._next
    t0 = time.perf_counter()
    value = hear(_plan_key(step, index), timeout)
    if value is None:
      self._waited += time.perf_counter() - t0
      if self._waited >= self._timeout:
        raise TimeoutError(
          f"trainer process {self.process} heard no plan for mini-batch {index} of step {step} "
          f"from process 0 within {self._timeout:.0f} s: process 0 stopped or is stalled."
        )
      return None
    self._waited = 0.0
    mb = records.from_json(MiniBatch, value["minibatch"])
    plan = records.from_json(ConsumerPlan, value["plan"])
    if (mb.step, mb.index) != (step, index) or plan.num_consumers != self.processes:
      raise RuntimeError(
        f"trainer process {self.process} expected mini-batch {(step, index)} for "
        f"{self.processes} consumers but heard {(mb.step, mb.index)} for {plan.num_consumers}."
      )
    self._plans[(step, index)] = plan
    self._next = (step, index + 1) if index + 1 < self._m else (step + 1, 0)
    return mb

  def plan_for(self, mb: MiniBatch) -> ConsumerPlan:
    """The announced plan of ``mb`` (the consumer's ``prepare`` asks once per mini-batch)."""
    plan = self._plans.pop((mb.step, mb.index), None)
    if plan is None:
      raise RuntimeError(f"no plan was announced for mini-batch {(mb.step, mb.index)}.")
    self._used[(mb.step, mb.index)] = plan
    return plan

  def record(self, prepared) -> None:
    """One row of ``fetched.p<k>.jsonl``: the plan used and what this process fetched."""
    mb = prepared.minibatch
    payload_bytes = prepared.info.get("fetched_bytes", 0.0)
    plan = self._used.pop((mb.step, mb.index))
    self._log.write(
      {
        "step": plan.step,
        "index": plan.index,
        "plan": [[g.group_id for g in groups] for groups in plan.groups],
        "fetched": [g.group_id for g in plan.groups[self.process]],
        "bytes": int(payload_bytes),
      }
    )

  def flush(self) -> None:
    self._log.flush()

  def close(self) -> None:
    self._log.close()


class FollowerPipe:
  """A follower's `knitjax.runtime.loop.Pipe`: the announced mini-batches, without a rollout.

  It takes the announcements as its feed's source, runs the same updates as the leader on the
  global mesh and publishes its shards of each version; the run state lives in process 0's
  checkpoint meta.
  """

  def __init__(self, config, learner, weights, plans: PlanBook, *, prepare, start: int, watch):
    self.config, self.learner, self.weights, self.plans = config, learner, weights, plans
    self.watch, self.finished = watch, start >= config.loop.steps
    self.weights.publish(learner.state.params, learner.version, block=True)
    m = config.admission.minibatches
    self.feed = build_feed(config, plans.take, prepare, count=(config.loop.steps - start) * m)
    self.t_start = self._t0 = time.time()

  def begin_step(self, step: int) -> None:
    self._t0 = time.time()
    self._w0 = publish_counters(self.weights)

  def consume(self, step: int) -> list[dict]:
    return [self._consume(step, j) for j in range(self.config.admission.minibatches)]

  def _consume(self, step: int, j: int) -> dict:
    t_wait = time.perf_counter()
    p = next(self.feed)
    t_got = time.perf_counter()
    mb = p.minibatch
    if (mb.step, mb.index) != (step, j):
      raise RuntimeError(f"announced mini-batch {(mb.step, mb.index)} came before {(step, j)}.")
    row = self.learner.consume(p)
    self.plans.record(p)
    if self.config.sync.every == "minibatch" or j == self.config.admission.minibatches - 1:
      self.weights.publish(self.learner.state.params, self.learner.version)
    return {**row, **p.info, **exposed_transfer(p, t_wait, t_got)}

  def end_step(self, step: int, last: bool) -> dict:
    if last:
      self.finished = True
    now = time.time()
    return {
      **publish_metrics(self._w0, publish_counters(self.weights)),
      "step_s": now - self._t0,
      "wall_s": now - self.t_start,
    }

  def snapshot(self) -> RunState:
    """Flushes ``fetched.p<k>.jsonl``; the run state itself is process 0's to write, so this
    process's checkpoint meta holds none (orbax writes only process 0's)."""
    self.plans.flush()
    return RunState()

  def close(self) -> None:
    self.watch.end(finished=self.finished)  # first: the leader may end (and the store) meanwhile
    self.feed.close()
    self.weights.close()
    self.plans.close()


def check_config(config) -> None:
  """What a trainer spread over processes needs of the config (one sentence if not met)."""
  if not config.topology.rollout_workers:
    raise ValueError(
      f"a disaggregated trainer of {jax.process_count()} processes takes its rollout from Ray "
      "workers: set config.topology.rollout_workers > 0 (in-process rollout serves a "
      "one-process trainer)."
    )
  if config.transfer.mode != "on_demand":
    raise ValueError(
      f"config.transfer.mode={config.transfer.mode!r} gathers whole steps on one driver; a "
      "multi-process trainer fetches on demand (transfer.mode='on_demand')."
    )


class TrainerProcesses:
  """`knitjax.distributed.topology.Topology`: a disaggregated trainer spread over processes.

  Process 0 (the leader) builds the Ray rollout and the admission index, creates the weights
  board and announces how to reach the cluster (Ray's address, the board, the storage units'
  names); the others hear it, join Ray and connect to the units by name. Every process trains
  on every device of the one global mesh. The pulse watch starts here, before anything is built:
  a process lost at any point ends the others with one sentence.
  """

  def __init__(self, config, *, workdir: str = ""):
    check_config(config)
    self._n, self._workdir = config.topology.rollout_workers, workdir
    self.watch = PulseWatch()
    self.leader = jax.process_index() == 0

  def split(self, devices: list) -> tuple[list, list]:
    return [], list(devices)

  def rollout(self, config, graphdef, mesh, prompts):
    return ray_rollout(config, prompts, workdir=self._workdir) if self.leader else None

  def pipe(self, config, workdir, learner, rollout, admission, prompts, train_mesh, resumed):
    start = learner.version // config.admission.minibatches
    plans = PlanBook(
      workdir,
      minibatches=config.admission.minibatches,
      start_step=start,
      locality_slack=config.pipeline.locality_slack,
    )
    if self.leader:
      import ray

      run = new_run_id()
      board = create_board(run, plans.processes)
      units = {str(i): name for i, name in rollout.unit_names.items()}
      address = ray.get_runtime_context().gcs_address
      local = not config.topology.ray_address  # the Ray process 0 started, token-authenticated
      announce("ray", {"address": address, "local": local, "run": run, "units": units})
      return Pipeline(
        config, workdir, learner, rollout, admission, prompts, resumed,
        train_mesh=train_mesh, weights=shard_publisher(config, board), plans=plans,
        watch=self.watch,
      )  # fmt: skip
    cluster = hear("ray", PLAN_TIMEOUT_S)
    if cluster is None:
      raise TimeoutError(
        f"trainer process {plans.process} heard nothing from process 0 within "
        f"{PLAN_TIMEOUT_S:.0f} s of starting: process 0 did not start its rollout."
      )
    if cluster["local"]:  # join it with the token process 0's Ray was started with (same user)
      os.environ.setdefault("RAY_AUTH_MODE", "token")
    ensure_ray(
      cluster["address"],
      needed_by="a multi-process disaggregated trainer",
      token_dir=self._workdir if cluster["local"] else "",
    )
    from knitjax.distributed.ray_storage import RayStorageUnit

    limits = build_storage_limits(config, prompts)
    storage = {
      int(i): RayStorageUnit.connect(name, limits, int(i)) for i, name in cluster["units"].items()
    }
    weights = shard_publisher(config, connect_board(cluster["run"]))
    prepare = build_preparer(config, storage, train_mesh, prompts, plan_for=plans.plan_for)
    return FollowerPipe(
      config, learner, weights, plans, prepare=prepare, start=start, watch=self.watch
    )

  def describe(self) -> str:
    return f"{self._n} Ray workers, {jax.process_count()} trainer processes"
