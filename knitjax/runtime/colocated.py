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
from knitjax.runtime import builder, rollout_builder
from knitjax.runtime.evaluation import plot_eval
from knitjax.runtime.learner import RunState
from knitjax.runtime.metrics import MetricsWriter, fault_counters, mean_rows, plot_reward
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.feed import exposed_transfer
from knitjax.transfer.storage import release_groups


def run(
  config: Config,
  workdir: str,
  *,
  on_step: Callable[[int, dict], None] | None = None,
  config_name: str | None = None,
) -> dict:
  """Trains for ``config.loop.steps`` train steps, resuming from ``workdir`` if possible.

  Args:
    config: the validated run config.
    workdir: where checkpoints, ``metrics.jsonl``, TensorBoard files and plots go.
    on_step: called after each train step with ``(step, metrics)``.
    config_name: the config's file and variant (``configs/arith_tiny.py:quick``), for the title
      of ``reward.png``.

  Returns:
    The last step's metrics.
  """
  mesh = builder.build_mesh(config)
  prompts = builder.build_prompts(config)
  graphdef, learner = builder.build_learner(config, mesh, workdir, prompt_len=prompts.prompt_len)
  rollout = rollout_builder.build_rollout(config, graphdef, mesh, prompts)
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
  start, total = learner.version // config.admission.minibatches, config.loop.steps
  writer = MetricsWriter(
    workdir,
    total_steps=total,
    start_step=start,
    log_every=config.loop.log_every,
    checkpoint_every=config.checkpoint.every_steps,
  )
  logging.info("training steps %d..%d on mesh %s", start + 1, total, dict(mesh.shape))
  prepare = builder.build_preparer(config, rollout.storage, mesh, prompts)
  evals = rollout_builder.build_periodic_eval(config, graphdef, mesh, prompts, workdir, start)
  metrics: dict = {}
  t_start = time.time()
  with jax.set_mesh(mesh):
    if evals is not None and start == 0:
      evals.maybe_run(0, learner.policy_params, rollout_builder.eval_rng(config))
    for step in range(start, total):
      t0 = time.time()
      released, lengths, next_group_id = _generate_step(
        config, rollout, admission, prompts, learner, step, next_group_id
      )
      t_train = time.time()
      feed = builder.build_feed(config, _from_list(released), prepare, count=len(released))
      rows = []
      for _ in released:
        t_want = time.perf_counter()
        p = next(feed)
        info = {**p.info, **exposed_transfer(p, t_want, time.perf_counter())}
        rows.append({**learner.consume(p), **info})
        release_groups(rollout.storage, p.minibatch.groups)
      now = time.time()
      metrics = {
        "version": learner.version,
        **mean_rows(rows),
        "tokens_per_s": sum(lengths) / (now - t0),
        "response_len_mean": sum(lengths) / max(1, len(lengths)),
        "step_s": now - t0,
        "rollout_s": t_train - t0,
        "train_s": now - t_train,
        "wall_s": now - t_start,  # from this process's first step; host work between steps too
        **fault_counters(rollout),
        **learner.tracker.step_metrics(step),
      }
      if evals is not None:
        metrics.update(
          evals.maybe_run(step + 1, learner.policy_params, rollout_builder.eval_rng(config))
        )
      writer.write(step + 1, metrics)
      learner.maybe_save(
        step + 1,
        total,
        lambda gid=next_group_id: RunState(
          next_group_id=gid,
          prompts=prompts.state_dict(),
          admission=admission.state_dict(),
        ),
      )
      if on_step is not None:
        on_step(step + 1, metrics)
  learner.close()
  writer.close()
  rollout.close()
  if writer.primary:
    plot_reward(workdir, config_name=config_name)
    plot_eval(workdir)
  return {"step": total, **metrics}


def _generate_step(config: Config, rollout, admission, prompts, learner, step: int, group_id: int):
  """Generates until the whole step is released (dynamic sampling can reject groups).

  Returns ``(released mini-batches, the generated responses' token counts, next group id)``.
  """
  rng = builder.rng_for(config.seed, step)
  quotas = config.admission.quotas
  released, lengths, chunk = [], [], 0
  while len(released) < config.admission.minibatches:
    need = {c: n for c, n in admission.remaining().items() if n > 0} or dict(quotas)
    metas = contract.generate(
      rollout,
      learner.policy_params,
      prompts.next({c: max(n, quotas[c]) for c, n in need.items()}),
      version=learner.version,
      rng=jax.random.fold_in(rng, chunk),
      first_group_id=group_id,
    )
    chunk += 1
    group_id += len(metas)
    faultpoints.point("rollout")
    for meta in metas:
      lengths += [int(n) for n in meta.response_tokens]
      released += admission.offer(meta)
      faultpoints.point("admission")
  return released, lengths, group_id


def _from_list(minibatches: list[MiniBatch]) -> Callable[[float], MiniBatch | None]:
  """A feed source over one step's released mini-batches."""
  it = iter(minibatches)
  return lambda timeout: next(it, None)
