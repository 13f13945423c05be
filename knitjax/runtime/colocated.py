"""Colocated execution: rollout and training take turns on one mesh.

Each train step generates complete groups with the current policy through the rollout contract
(payloads into the rollout's storage units), offers them to the admission index (the same parts
the disaggregated runtime uses), and hands the M released mini-batches through the on-demand feed
to the Learner, one optimizer update each. Staleness here is exactly the colocated gap ``j``,
which makes this loop the reference that architectural staleness is measured against.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
from absl import logging

from knitjax import faultpoints
from knitjax.config import Config
from knitjax.rollout import contract
from knitjax.runtime import builder, loop, rollout_builder
from knitjax.runtime.learner import Learner, RunState
from knitjax.runtime.metrics import fault_counters
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.feed import exposed_transfer
from knitjax.transfer.storage import release_groups


def run(
  config: Config,
  workdir: str,
  topology: loop.Topology,
  *,
  on_step: Callable[[int, dict], None] | None = None,
  on_batch: Callable | None = None,
  config_name: str | None = None,
) -> dict:
  """Trains for ``config.loop.steps`` train steps, resuming from ``workdir`` if possible.

  Args:
    config: the validated run config.
    workdir: where checkpoints, ``metrics.jsonl``, TensorBoard files and plots go.
    topology: where the rollout and its storage units are (`knitjax.distributed.topology`).
    on_step: called after each train step with ``(step, metrics)``.
    on_batch: called with ``(mini-batch, train batch)`` before each update (`Learner`).
    config_name: the config's file and variant (``configs/arith_tiny.py:quick``), for the title
      of ``reward.png``.

  Returns:
    The last step's metrics.
  """
  mesh = builder.build_mesh(config)
  prompts = builder.build_prompts(config)
  graphdef, learner = builder.build_learner(
    config, mesh, workdir, prompt_len=prompts.prompt_len, on_batch=on_batch
  )
  rollout = topology.rollout(config, graphdef, mesh, prompts)
  admission = builder.build_admission(
    config, on_reject=lambda g: release_groups(rollout.storage, [g])
  )
  next_group_id = 0
  if (resumed := learner.restore()) is not None:
    next_group_id = resumed.next_group_id
    prompts.load_state_dict(resumed.prompts)
    admission.load_state_dict(resumed.admission)
    if admission.pending():
      raise RuntimeError("a colocated checkpoint must not hold pending groups.")
  start = learner.version // config.admission.minibatches
  logging.info("training steps %d..%d on mesh %s", start + 1, config.loop.steps, dict(mesh.shape))
  prepare = builder.build_preparer(config, rollout.storage, mesh, prompts)
  evals = rollout_builder.build_periodic_eval(config, graphdef, mesh, prompts, workdir, start)
  steps = ColocatedSteps(config, learner, rollout, admission, prompts, prepare, next_group_id)
  return loop.run_steps(
    config, workdir, steps, learner, mesh, evals=evals, on_step=on_step, config_name=config_name
  )


class ColocatedSteps:
  """The colocated `loop.Pipe`: each step generates its groups, then consumes them.

  A step's feed is built over that step's released mini-batches only: one feed across steps
  would prefetch past a step boundary, asking for a mini-batch not yet generated.
  """

  def __init__(
    self,
    config: Config,
    learner: Learner,
    rollout,
    admission,
    prompts,
    prepare,
    next_group_id: int,
  ):
    self.config, self.learner, self.rollout = config, learner, rollout
    self.admission, self.prompts, self.prepare = admission, prompts, prepare
    self.next_group_id = next_group_id
    self.t_start = time.time()  # wall_s counts from here; host work between steps too

  def begin_step(self, step: int) -> None:
    self._t0 = time.time()
    self._released, self._lengths = self._generate(step)
    self._t_train = time.time()

  def _generate(self, step: int) -> tuple[list[MiniBatch], list[int]]:
    """Generates until the whole step is released (dynamic sampling can reject groups).

    Returns the released mini-batches and the generated responses' token counts.
    """
    config, admission = self.config, self.admission
    rng = builder.rng_for(config.seed, step)
    quotas = config.admission.quotas
    released, lengths, chunk = [], [], 0
    while len(released) < config.admission.minibatches:
      need = {c: n for c, n in admission.remaining().items() if n > 0} or dict(quotas)
      metas = contract.generate(
        self.rollout,
        self.learner.policy_params,
        self.prompts.next({c: max(n, quotas[c]) for c, n in need.items()}),
        version=self.learner.version,
        rng=jax.random.fold_in(rng, chunk),
        first_group_id=self.next_group_id,
      )
      chunk += 1
      self.next_group_id += len(metas)
      faultpoints.point("rollout")
      for meta in metas:
        lengths += [int(n) for n in meta.response_tokens]
        released += admission.offer(meta)
        faultpoints.point("admission")
    return released, lengths

  def consume(self, step: int) -> list[dict]:
    released = self._released
    feed = builder.build_feed(self.config, _from_list(released), self.prepare, count=len(released))
    rows = []
    for _ in released:
      t_want = time.perf_counter()
      p = next(feed)
      info = {**p.info, **exposed_transfer(p, t_want, time.perf_counter())}
      rows.append({**self.learner.consume(p), **info})
      release_groups(self.rollout.storage, p.minibatch.groups)
    return rows

  def end_step(self, step: int, last: bool) -> dict:
    now, t0, lengths = time.time(), self._t0, self._lengths
    return {
      "tokens_per_s": sum(lengths) / (now - t0),
      "response_len_mean": sum(lengths) / max(1, len(lengths)),
      "step_s": now - t0,
      "rollout_s": self._t_train - t0,
      "train_s": now - self._t_train,
      "wall_s": now - self.t_start,
      **fault_counters(self.rollout),
    }

  def snapshot(self) -> RunState:
    """The host side of a colocated checkpoint: every step ends with nothing pending."""
    return RunState(
      next_group_id=self.next_group_id,
      prompts=self.prompts.state_dict(),
      admission=self.admission.state_dict(),
    )

  def close(self) -> None:
    self.rollout.close()


def _from_list(minibatches: list[MiniBatch]) -> Callable[[float], MiniBatch | None]:
  """A feed source over one step's released mini-batches."""
  it = iter(minibatches)
  return lambda timeout: next(it, None)
