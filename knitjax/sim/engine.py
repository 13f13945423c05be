"""The discrete-event loop: rollout slots -> real admission index -> trainer -> weight sync.

Events are per sample slot (a heap on the rollout's token clock, `rollout.SlotPool`), per group
completion, and per trainer mini-batch; nothing runs per token. Every complete group is offered
once to the real `knitjax.transfer.admission.AdmissionIndex` (the same one the runtime uses), and
the mini-batches it releases are what the trainer computes, so admission behaviour is never
re-implemented here.

Pipeline depth (`Pipeline.max_lag_steps` = D) bounds submission like AReaL's
``max_head_offpolicyness``, in train steps: a group may start only while the accepted groups
started so far (started minus rejected) are fewer than ``B * (completed_steps + 1 + D)``; with
``Pipeline.lag_unit="minibatch"`` capacity comes back per consumed mini-batch
(`knitjax.rollout.versions.start_limit`, the runtime's rule too).
"""

import dataclasses
import heapq
import math
import time

import numpy as np

from knitjax.rollout.versions import start_limit
from knitjax.sim.lengths import LengthSampler
from knitjax.sim.rollout import SlotPool
from knitjax.sim.scheduling import make_scheduler
from knitjax.sim.trainer import Trainer
from knitjax.sim.workload import Pipeline, Workload
from knitjax.transfer.admission import AdmissionIndex, MiniBatch
from knitjax.transfer.group import GroupMeta


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimResult:
  """Everything one simulation measured (see `knitjax.sim.metrics.summarize` for the metrics).

  Per-group arrays (index = group id, one entry per started group): ``cls`` (class index),
  ``gen_version``, ``gen_version_newest``, ``t_start``, ``t_complete`` (NaN while generating),
  ``t_depart`` (consumption or rejection time; NaN otherwise), ``version_complete`` (trainer
  version when the group completed; -1 while generating), ``outcome`` (0 generating, 1
  pending in the index, 2 queued at the trainer, 3 consumed, 4 rejected).
  Per-consumed-group arrays in consumption order: ``consumed_id``, ``consumed_step``,
  ``consumed_index`` (colocated gap j), ``consume_version``.
  Window (after ``warmup_steps``) accumulators: ``t_window_start``, ``t_end``,
  ``trainer_busy_s``, ``slot_busy_s`` (slot-seconds held), ``system_area`` (integral of groups
  in the system: started and neither consumed nor rejected).
  """

  workload: Workload
  pipeline: Pipeline
  num_steps: int
  warmup_steps: int
  seed: int
  cls: np.ndarray
  gen_version: np.ndarray
  gen_version_newest: np.ndarray
  t_start: np.ndarray
  t_complete: np.ndarray
  t_depart: np.ndarray
  version_complete: np.ndarray
  outcome: np.ndarray
  consumed_id: np.ndarray
  consumed_step: np.ndarray
  consumed_index: np.ndarray
  consume_version: np.ndarray
  t_window_start: float
  t_end: float
  trainer_busy_s: float
  slot_busy_s: float
  system_area: float
  sync_pause_s: float
  index_stats: dict
  deadlocks: int
  wall_s: float


GENERATING, PENDING, QUEUED, CONSUMED, REJECTED = range(5)


class _Simulation:
  """Mutable state of one run; `simulate` is the public entry."""

  def __init__(self, w: Workload, p: Pipeline, *, num_steps: int, warmup_steps: int, seed: int):
    self.w, self.p = w, p
    self.colocated = p.mode == "colocated"
    self.lag = 0 if self.colocated else p.lag_groups(w)
    self.B, self.M, self.G = w.groups_per_step, w.minibatches, w.group_size
    self.target = num_steps * self.M
    self.warmup_versions = warmup_steps * self.M
    self.mid_generation = p.adoption == "mid_generation"
    self.sync_every = 1 if p.weight_sync == "minibatch" else self.M
    self.index = AdmissionIndex(w.quota_spec(), p.policy, dynamic_sampling=True)
    quotas = [c.quota for c in w.classes]
    self.scheduler = make_scheduler(
      p.scheduling, self.index, quotas, 1 + math.ceil(self.lag / self.B)
    )
    self.pool = SlotPool(w.slots, w.decode_s_per_token, w.occupancy_slowdown)
    self.trainer = Trainer(w.trainer_s_per_token, w.trainer_overhead_s)
    seeds = np.random.SeedSequence(seed).spawn(2)
    self.lengths = LengthSampler(w.classes, int(seeds[0].generate_state(1)[0]))
    self._reject_rng = np.random.default_rng(seeds[1])
    self._reject_u = np.empty(0)
    self.names = [c.name for c in w.classes]
    self.reject_prob = [c.reject_prob for c in w.classes]
    self.prompt = [(c.prompt_tokens,) * self.G for c in w.classes]
    # Prefill runs in the sample's own slot; in decode iterations at the base iteration time.
    self.prefill_iters = [
      c.prompt_tokens * w.prefill_s_per_token / w.decode_s_per_token for c in w.classes
    ]
    self.rollout_version = 0
    self._reports: list[tuple[float, int]] = []  # heap of (offer time, group id), report delay
    self.accepted_started = 0
    self.in_system = 0
    self.system_area = 0.0
    self.t_area = 0.0
    self.deadlocks = 0
    # Per group, by group id.
    self.g_cls: list[int] = []
    self.g_gen: list[int] = []
    self.g_newest: list[int] = []
    self.g_tokens: list[int] = []
    self.g_lengths: list[np.ndarray] = []
    self.g_t_start: list[float] = []
    self.g_t_complete: list[float] = []
    self.g_t_depart: list[float] = []
    self.g_v_complete: list[int] = []
    self.g_outcome: list[int] = []
    # Per consumed group.
    self.c_id: list[int] = []
    self.c_step: list[int] = []
    self.c_index: list[int] = []
    self.c_version: list[int] = []
    self.window = None  # (t, slot area, trainer busy, system area) at the end of warmup

  # ---- bookkeeping ------------------------------------------------------------------------------

  def _system(self, t: float, delta: int) -> None:
    self.system_area += self.in_system * (t - self.t_area)
    self.t_area = t
    self.in_system += delta

  def _reject_draw(self, gid: int) -> float:
    if gid >= self._reject_u.size:
      self._reject_u = np.concatenate([self._reject_u, self._reject_rng.random(1 << 16)])
    return self._reject_u[gid]

  def _tokens(self, mb: MiniBatch) -> int:
    return sum(self.g_tokens[g.group_id] for g in mb.groups)

  # ---- rollout ----------------------------------------------------------------------------------

  def _start_group(self, c: int) -> None:
    t = self.pool.t
    gid = len(self.g_cls)
    lengths = self.lengths.take(c, self.G)
    self.pool.start(gid, lengths + self.prefill_iters[c])
    if self.w.group_start_pause_s > 0:
      self.pool.pause(self.w.group_start_pause_s, sync=False)
    self.scheduler.on_start(c)
    self.accepted_started += 1
    self._system(t, +1)
    self.g_cls.append(c)
    self.g_gen.append(self.rollout_version)
    self.g_newest.append(self.rollout_version)
    self.g_tokens.append(int(lengths.sum()) + self.G * self.w.classes[c].prompt_tokens)
    self.g_lengths.append(lengths)
    self.g_t_start.append(t)
    self.g_t_complete.append(math.nan)
    self.g_t_depart.append(math.nan)
    self.g_v_complete.append(-1)
    self.g_outcome.append(GENERATING)

  def _try_start(self) -> None:
    pool, trainer = self.pool, self.trainer
    limit = start_limit(
      trainer.version,
      groups_per_step=self.B,
      minibatches=self.M,
      lag_groups=self.lag,
      lag_unit=self.p.lag_unit,
    )
    cap = self.p.max_inflight_groups
    while pool.free >= self.G and self.accepted_started < limit:
      if cap and pool.inflight_groups >= cap:
        return
      if self.colocated and not (trainer.idle and not trainer.queue):
        return  # colocated: the devices are training
      c = self.scheduler.next_class()
      if c is None:
        return  # admission-aware throttle: nothing is needed now
      self._start_group(c)

  def _complete(self, gid: int) -> None:
    t = self.pool.t
    c = self.g_cls[gid]
    gen = self.g_gen[gid]
    newest = self.rollout_version if self.mid_generation else gen
    self.g_newest[gid] = newest
    self.g_t_complete[gid] = t
    self.g_v_complete[gid] = self.trainer.version
    accepted = self._reject_draw(gid) >= self.reject_prob[c]
    meta = GroupMeta(
      group_id=gid,
      cls=self.names[c],
      gen_version=gen,
      num_samples=self.G,
      prompt_tokens=self.prompt[c],
      response_tokens=tuple(self.g_lengths[gid].tolist()),
      reward_mean=0.5 if accepted else 0.0,
      reward_std=0.5 if accepted else 0.0,  # dynamic sampling rejects zero-variance groups
      completion_time=t,
      gen_version_newest=newest if newest != gen else None,
    )
    self.g_lengths[gid] = None  # the index holds the lengths now; keep memory flat
    released = self.index.offer(meta)
    self.scheduler.on_complete(c, accepted)
    if accepted:
      self.g_outcome[gid] = PENDING
    else:
      self.g_outcome[gid] = REJECTED
      self.g_t_depart[gid] = t
      self.accepted_started -= 1
      self._system(t, -1)
    for mb in released:
      for g in mb.groups:
        self.g_outcome[g.group_id] = QUEUED
      self.trainer.queue.append(mb)

  # ---- trainer ----------------------------------------------------------------------------------

  def _try_train(self, t: float) -> None:
    trainer = self.trainer
    if not trainer.idle or not trainer.queue:
      return
    if self.colocated and self.pool.inflight_groups:
      return  # colocated: the devices are generating
    # Trainer and rollout on the same cores: a mini-batch started while groups generate is slower.
    contended = self.w.trainer_contended_s if self.pool.inflight_groups else 0.0
    mb = trainer.start(t, self._tokens, contended)
    for g in mb.groups:
      gid = g.group_id
      self.g_outcome[gid] = CONSUMED
      self.g_t_depart[gid] = t
      self.c_id.append(gid)
      self.c_step.append(mb.step)
      self.c_index.append(mb.index)
      self.c_version.append(trainer.version)
    self._system(t, -len(mb.groups))

  def _finish_train(self, t: float) -> None:
    self.trainer.finish()
    v = self.trainer.version
    if v % self.sync_every == 0:
      self.rollout_version = v
      self.pool.pause(self.w.weight_sync_s)
    if v == self.warmup_versions:
      self._system(t, 0)
      self.window = (t, self.pool.busy_area, self.trainer.busy_total, self.system_area)
    if v % self.M == 0 and self.w.trainer_step_overhead_s > 0 and v < self.target:
      self.trainer.hold(t, self.w.trainer_step_overhead_s)

  def _break_deadlock(self) -> None:
    """Nothing can happen: the depth bound is full of groups the open step cannot use (e.g. plain
    scheduling overproduced a class that dynamic sampling rejects less). Counted as a stall; the
    rollout then starts, beyond the bound, the groups the open step still lacks."""
    self.deadlocks += 1
    remaining = self.index.remaining(1)
    lacking = [c for c, n in enumerate(self.names) for _ in range(remaining[n])]
    if not lacking or self.deadlocks > 10 * (self.target + 1):
      raise RuntimeError(
        f"simulation cannot progress at version {self.trainer.version}: no group is generating, "
        f"none is needed, and the trainer has nothing to train (index: {self.index.stats()})."
      )
    for c in lacking[: self.pool.free // self.G]:
      self._start_group(c)

  # ---- loop -------------------------------------------------------------------------------------

  def run(self) -> None:
    pool, trainer, G = self.pool, self.trainer, self.G
    if self.warmup_versions == 0:
      self.window = (0.0, 0.0, 0.0, 0.0)
    self._try_start()
    while trainer.version < self.target:
      t_r, kind = pool.next_event()
      t_tr = trainer.busy_until
      t_rep = self._reports[0][0] if self._reports else math.inf
      if t_rep < t_r and t_rep < t_tr:  # a finished group reaches admission (report delay)
        pool.advance(t_rep)
        self._complete(heapq.heappop(self._reports)[1])
        self._try_train(t_rep)
        self._try_start()
      elif t_tr <= t_r:
        if t_tr == math.inf:
          self._break_deadlock()
          continue
        pool.advance(t_tr)
        if trainer.holding:
          trainer.end_hold()
        else:
          self._finish_train(t_tr)
        if trainer.version >= self.target:
          break
        self._try_train(t_tr)
        self._try_start()
      elif kind == 0:
        pool.pop_slot(t_r)
        if pool.free >= G:
          self._try_start()
      else:
        gid = pool.pop_group(t_r)
        if self.w.report_delay_s > 0:  # offered once the engine hands it back
          heapq.heappush(self._reports, (t_r + self.w.report_delay_s, gid))
          continue
        self._complete(gid)
        self._try_train(t_r)
        self._try_start()
    self._system(pool.t, 0)


def simulate(
  workload: Workload, pipeline: Pipeline, *, num_steps: int, warmup_steps: int = 0, seed: int = 0
) -> SimResult:
  """Runs the pipeline on the workload until ``num_steps`` train steps are trained.

  Args:
    workload: classes, cluster and cost model.
    pipeline: policy, mode, depth, weight sync, adoption and scheduling.
    num_steps: train steps to train.
    warmup_steps: leading steps left out of the window metrics (the pipeline filling up).
    seed: seeds the lengths and the dynamic-sampling draws; equal seeds give equal results.

  Returns:
    The `SimResult`.
  """
  if num_steps < 1 or not 0 <= warmup_steps < num_steps:
    raise ValueError(
      f"simulate: num_steps={num_steps!r} must be >= 1 and warmup_steps={warmup_steps!r} in "
      "[0, num_steps)."
    )
  t0 = time.perf_counter()
  sim = _Simulation(workload, pipeline, num_steps=num_steps, warmup_steps=warmup_steps, seed=seed)
  sim.run()
  wall_s = time.perf_counter() - t0
  t_w, slot_w, trainer_w, area_w = sim.window
  f64 = lambda x: np.asarray(x, np.float64)
  i64 = lambda x: np.asarray(x, np.int64)
  return SimResult(
    workload=workload,
    pipeline=pipeline,
    num_steps=num_steps,
    warmup_steps=warmup_steps,
    seed=seed,
    cls=i64(sim.g_cls),
    gen_version=i64(sim.g_gen),
    gen_version_newest=i64(sim.g_newest),
    t_start=f64(sim.g_t_start),
    t_complete=f64(sim.g_t_complete),
    t_depart=f64(sim.g_t_depart),
    version_complete=i64(sim.g_v_complete),
    outcome=i64(sim.g_outcome),
    consumed_id=i64(sim.c_id),
    consumed_step=i64(sim.c_step),
    consumed_index=i64(sim.c_index),
    consume_version=i64(sim.c_version),
    t_window_start=t_w,
    t_end=sim.pool.t,
    trainer_busy_s=sim.trainer.busy_total - trainer_w,
    slot_busy_s=sim.pool.busy_area - slot_w,
    system_area=sim.system_area - area_w,
    sync_pause_s=sim.pool.pause_total,
    index_stats=sim.index.stats(),
    deadlocks=sim.deadlocks,
    wall_s=wall_s,
  )
