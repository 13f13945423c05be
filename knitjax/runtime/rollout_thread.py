"""The rollout worker of the disaggregated runtime: a thread driving the continuous engine.

It starts groups (prompts from the per-class streams in quota proportion) while the depth bound
allows and the engine has G free slots, adopts each newly published policy version, and turns
finished samples into complete groups: reward -> dynamic-sampling filter -> storage unit ->
admission index. What the index releases goes to the trainer's queue.

One lock (``lock``) makes "offer a group, queue what it released" atomic with respect to the
trainer's checkpoint snapshot, so a checkpoint always sees every offered group exactly once:
pending in the index, queued, or consumed. Storage puts happen outside it, as they may wait for
room (backpressure) until the trainer releases consumed groups.
"""

from __future__ import annotations

import collections
import threading
import time

import jax
import numpy as np

from knitjax.rollout.continuous import ContinuousEngine, Finished, Request
from knitjax.rollout.scheduling import PlainScheduler
from knitjax.rollout.worker import assemble_group
from knitjax.runtime.released import ReleasedQueue
from knitjax.runtime.versions import VersionClock
from knitjax.runtime.weight_sync import WeightSync
from knitjax.tasks.prompts import Prompt
from knitjax.transfer.admission import AdmissionIndex
from knitjax.transfer.storage import StorageUnit

_IDLE_WAIT_S = 0.5


def prompt_to_dict(p: Prompt) -> dict:
  return {
    "prompt_id": p.prompt_id,
    "cls": p.cls,
    "text": p.text,
    "tokens": p.tokens.tolist(),
    "answer": p.answer,
  }


def prompt_from_dict(d: dict) -> Prompt:
  return Prompt(**{**d, "tokens": np.asarray(d["tokens"], np.int32)})


class RolloutThread:
  """Generates complete groups concurrently with training (see the module docstring).

  Args:
    engine: the continuous-batching engine on the rollout mesh.
    prompts: the per-class prompt streams (`knitjax.runtime.builder.Prompts`).
    reward_fn: the verifier.
    group_size: ``G``.
    budgets: max new tokens per class.
    storage: the storage unit payloads go to.
    admission: the admission index (shared with the trainer's checkpoints, under ``lock``).
    queue: where released mini-batches go.
    clock: the trainer's version and the depth bound.
    weights: published policy versions.
    lock: guards the index, the queue pushes, the prompt streams and the group counter.
    next_group_id: first group id to hand out.
    accepted_started: groups started so far minus rejected ones (the depth bound counts them).
    restart: prompts of groups that were generating at the checkpoint; they start first.
    rng: base key of the engine's draws.
    on_offer: called under ``lock`` after each offer with ``(group meta, prompt, rejected)``.
  """

  def __init__(
    self,
    *,
    engine: ContinuousEngine,
    prompts,
    reward_fn,
    group_size: int,
    budgets: dict[str, int],
    storage: StorageUnit,
    admission: AdmissionIndex,
    queue: ReleasedQueue,
    clock: VersionClock,
    weights: WeightSync,
    lock: threading.Lock,
    next_group_id: int,
    accepted_started: int,
    restart: list[Prompt] = (),
    rng: jax.Array,
    on_offer=None,
  ):
    self.engine, self.prompts, self.reward_fn = engine, prompts, reward_fn
    self.g, self.budgets = group_size, budgets
    self.storage, self.admission, self.queue = storage, admission, queue
    self.clock, self.weights, self.lock = clock, weights, lock
    self.next_group_id = next_group_id
    self.accepted_started = accepted_started
    self._restart = collections.deque(restart)
    self._rng = rng
    self._on_offer = on_offer
    classes = list(admission.spec.classes)
    self._classes = classes
    self._scheduler = PlainScheduler([admission.spec.class_quotas[c] for c in classes])
    self._inflight: dict[int, dict] = {}
    self._thread = threading.Thread(target=self._main, name="rollout", daemon=True)
    self.error: BaseException | None = None
    # Counters read by the trainer for metrics (plain numbers: one writer, GIL-atomic reads).
    self.busy_s = 0.0
    self.idle_s = 0.0
    self.tokens = 0
    self.groups_started = 0
    self.groups_completed = 0
    # Per engine call: (end time, seconds, decode iterations, groups started, live samples before).
    self.calls: list[tuple[float, float, int, int, int]] = []
    self.lengths: dict[str, list[int]] = {c: [] for c in classes}

  # ---- control ------------------------------------------------------------------------------

  def start(self) -> None:
    self._thread.start()

  def join(self, timeout: float | None = None) -> None:
    self._thread.join(timeout)

  def is_alive(self) -> bool:
    return self._thread.is_alive()

  @property
  def inflight_groups(self) -> int:
    return len(self._inflight)

  def inflight_prompts(self) -> list[Prompt]:
    """Prompts of the groups generating now, oldest first (call under ``lock``)."""
    return [v["prompt"] for _, v in sorted(self._inflight.items())] + list(self._restart)

  # ---- loop ---------------------------------------------------------------------------------

  def _main(self) -> None:
    try:
      self._loop()
    except BaseException as e:  # surfaced by the trainer, which then stops
      self.error = e
      self.clock.stop()

  def _loop(self) -> None:
    engine, g = self.engine, self.g
    call = 0
    while not self.clock.stopped:
      t0 = time.perf_counter()
      seen = self.clock.version
      newer = self.weights.take_newer(engine.version)
      if newer is not None:
        engine.load(newer[1], newer[0])
      limit = self.clock.limit()
      requests = []
      while (
        engine.version is not None
        and self.accepted_started < limit
        and engine.free_slots - len(requests) >= g
        and len(requests) + g <= engine.refill_rows
      ):
        requests += self._start_group()
      if not requests and engine.live_samples == 0:
        self.clock.wait(seen, _IDLE_WAIT_S)  # nothing to do until the trainer moves on
        self.idle_s += time.perf_counter() - t0
        continue
      iters = engine.decode_iterations
      more = self.accepted_started < limit
      live = engine.live_samples
      finished = engine.step(
        requests, rng=jax.random.fold_in(self._rng, call), stop_free=g if more else 0
      )
      call += 1
      self._finish(finished)
      dt = time.perf_counter() - t0
      self.busy_s += dt
      self.calls.append(
        (time.time(), dt, engine.decode_iterations - iters, len(requests) // g, live)
      )

  def _start_group(self) -> list[Request]:
    with self.lock:
      if self._restart:
        prompt = self._restart.popleft()
      else:
        cls = self._classes[self._scheduler.next_class()]
        prompt = self.prompts.next({cls: 1})[0]
      gid = self.next_group_id
      self.next_group_id += 1
      self._inflight[gid] = {"prompt": prompt, "samples": [None] * self.g}
    self.accepted_started += 1
    self.groups_started += 1
    budget = self.budgets[prompt.cls]
    return [
      Request(tag=(gid, k), tokens=prompt.tokens, max_new_tokens=budget) for k in range(self.g)
    ]

  def _finish(self, finished: list[Finished]) -> None:
    for f in finished:
      gid, k = f.tag
      entry = self._inflight[gid]
      entry["samples"][k] = f
      self.tokens += len(f.tokens)
      if all(s is not None for s in entry["samples"]):
        self._complete(gid, entry)

  def _complete(self, gid: int, entry: dict) -> None:
    samples: list[Finished] = entry["samples"]
    prompt = entry["prompt"]
    n = self.engine.sampling.max_new_tokens
    tokens = np.zeros((self.g, n), np.int32)
    logprobs = np.zeros((self.g, n), np.float32)
    lengths = np.array([len(s.tokens) for s in samples], np.int32)
    for k, s in enumerate(samples):
      tokens[k, : lengths[k]] = s.tokens
      logprobs[k, : lengths[k]] = s.logprobs
    group = assemble_group(
      prompt,
      tokens,
      lengths,
      logprobs,
      group_id=gid,
      version=min(s.version for s in samples),
      version_newest=max(s.version_newest for s in samples),
      reward_fn=self.reward_fn,
      tokenizer=self.prompts.tokenizer,
      storage_unit=self.storage.unit_id,
      completion_time=time.time(),
    )
    self.lengths[prompt.cls] += lengths.tolist()
    rejected = self.admission.dynamic_sampling and group.meta.reward_std == 0
    if not rejected:  # a rejected group's payload is never stored
      self.storage.put(gid, group.payload)
    with self.lock:
      del self._inflight[gid]
      for mb in self.admission.offer(group.meta):
        self.queue.put(mb)
      if self._on_offer is not None:
        self._on_offer(group.meta, prompt, rejected)
    self.groups_completed += 1
    self.accepted_started -= rejected
