"""Colocated execution: rollout and training take turns on one mesh.

Each train step generates complete groups with the current policy, passes
them through the storage unit and the admission index (the same parts the
disaggregated runtime uses), and applies the M released mini-batches as M
optimizer updates. Staleness here is exactly the colocated gap ``j``, which
makes this loop the reference that architectural staleness is measured
against.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np
from absl import logging

from knitjax.config import Config
from knitjax.runtime import builder
from knitjax.runtime.metrics import MetricsWriter, plot_reward
from knitjax.train.checkpoint import Checkpointer
from knitjax.train.step import host_metrics
from knitjax.transfer.admission import MiniBatch
from knitjax.transfer.feed import OnDemandFeed, exposed_transfer
from knitjax.transfer.staleness import StalenessTracker


def run(
  config: Config, workdir: str, *, on_step: Callable[[int, dict], None] | None = None
) -> dict:
  """Trains for ``config.runtime.steps`` train steps, resuming from ``workdir`` if possible.

  Args:
    config: the validated run config.
    workdir: where checkpoints, ``metrics.jsonl``, TensorBoard files and plots go.
    on_step: called after each train step with ``(step, metrics)``.

  Returns:
    The last step's metrics.
  """
  mesh = builder.build_mesh(config)
  prompts = builder.build_prompts(config)
  graphdef, state, shardings, train_step, ref = builder.init_state(config, mesh)
  rollout = builder.build_rollout(config, graphdef, mesh, prompts)
  storage = rollout.storage  # unit id -> storage unit
  admission = builder.build_admission(config, on_reject=lambda g: _release(storage, [g]))
  tracker = StalenessTracker()
  ckpt = Checkpointer(workdir, keep=config.checkpoint.keep)
  m_per_step = config.admission.minibatches
  version, next_group_id = 0, 0

  if ckpt.latest_step() is not None:
    state, meta = ckpt.restore(state)
    version, next_group_id = meta["version"], meta["next_group_id"]
    prompts.load_state_dict(meta["prompts"])
    admission.load_state_dict(meta["admission"])
    tracker.load_state_dict(meta["staleness"])
    if admission.pending():
      raise RuntimeError("a colocated checkpoint must not hold pending groups.")
  start_step = version // m_per_step
  total = config.runtime.steps
  writer = MetricsWriter(
    workdir, total_steps=total, start_step=start_step, log_every=config.runtime.log_every
  )
  logging.info("training steps %d..%d on mesh %s", start_step + 1, total, dict(mesh.shape))
  prepare = builder.build_prepare(config, storage, mesh, prompts)
  metrics: dict = {}
  t_start = time.time()
  with jax.set_mesh(mesh):
    for step in range(start_step, total):
      t0 = time.time()
      rng = builder.rng_for(config.seed, step)
      released, gen_tokens, rollout_s, chunk = [], 0, 0.0, 0
      # Generate until the whole step has been released (dynamic sampling can reject groups).
      while len(released) < m_per_step:
        need = admission.remaining()
        counts = {c: n for c, n in need.items() if n > 0} or dict(config.admission.quotas)
        counts = {c: max(n, config.admission.quotas[c]) for c, n in counts.items()}
        t_r = time.time()
        metas = rollout.generate(  # payloads go to the rollout's storage units
          state.params,
          prompts.next(counts),
          version=version,
          rng=jax.random.fold_in(rng, chunk),
          first_group_id=next_group_id,
        )
        rollout_s += time.time() - t_r
        chunk += 1
        next_group_id += len(metas)
        for meta in metas:
          gen_tokens += sum(meta.response_tokens)
          released += admission.offer(meta)

      t_t = time.time()
      step_metrics: list[dict] = []
      infos: list[dict] = []
      feed = OnDemandFeed(
        _from_list(released), prepare, count=len(released), prefetch=config.runtime.prefetch
      )
      for _ in released:
        t_want = time.perf_counter()
        p = next(feed)
        mb, device_batch = p.minibatch, p.batch
        info = {**p.info, **exposed_transfer(p, t_want, time.perf_counter())}
        state, m = (
          train_step(state, device_batch, ref)
          if ref is not None
          else train_step(state, device_batch)
        )
        tracker.record(mb, consume_version=version)
        version += 1
        _release(storage, mb.groups)
        step_metrics.append(m)
        infos.append(info)
      step_metrics = [host_metrics(m) for m in step_metrics]
      now = time.time()
      train_s, step_s = now - t_t, now - t0
      metrics = {
        "version": version,
        **{k: float(np.mean([m[k] for m in step_metrics])) for k in step_metrics[0]},
        **{k: float(np.mean([i[k] for i in infos])) for k in infos[0]},
        "tokens_per_s": gen_tokens / step_s,
        "step_s": step_s,
        "rollout_s": rollout_s,
        "train_s": train_s,
        "wall_s": now - t_start,  # from this process's first step; host work between steps too
        **tracker.step_metrics(step),
      }
      done = step + 1
      writer.write(done, metrics)
      if done % config.checkpoint.every_steps == 0 or done == total:
        ckpt.save(
          done,
          state,
          {
            "version": version,
            "next_group_id": next_group_id,
            "prompts": prompts.state_dict(),
            "admission": admission.state_dict(),
            "staleness": tracker.state_dict(),
          },
        )
      if on_step is not None:
        on_step(done, metrics)
  ckpt.close()
  writer.close()
  rollout.close()
  if writer.primary:
    plot_reward(workdir)
  return {"step": total, **metrics}


def _from_list(minibatches: list[MiniBatch]) -> Callable[[float], MiniBatch | None]:
  """A feed source over one step's released mini-batches."""
  it = iter(minibatches)
  return lambda timeout: next(it, None)


def _release(storage: dict, groups) -> None:
  """Releases consumed (or rejected) groups in the units that hold them."""
  by_unit: dict[int, list[int]] = {}
  for g in groups:
    by_unit.setdefault(g.storage_unit, []).append(g.group_id)
  for unit, ids in by_unit.items():
    storage[unit].release(ids)
