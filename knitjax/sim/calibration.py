"""The simulator's cost model, calibrated from a real run's measured timings, and its prediction.

Disaggregated run (`timings.json` of `knitjax.runtime.disaggregated`), over the measurement
window (after the warmup steps):

* Rollout engine calls, from the engine's own call timeline (``engine_calls`` in timings.json,
  `engine_timeline_fit`): ``b``, the device seconds per decode pass, is fitted on the calls the host
  found still running when it came to collect them (their device time is seen, also while host
  work overlaps the calls); the rest of the rollout's busy time (loop seconds
  of `calls`, idle waits excluded) is charged to group starts, ``c_g = (busy - b * decode passes) /
  groups started``, so the simulated rollout does the measured work; ``group_start_stall_fraction``
  is the engine's stall measured on the timeline (host gaps while samples were held, per-call costs,
  prefill chunks). The engine hands finished samples back only when the host collects a call, so a
  group reaches admission after its last sample ends by ``report_delay_s``: the mean over calls of
  ``collect end - launch - device seconds / 2`` (a sample ends, on average, half-way through its
  call). Runs without a usable timeline (rollout hosts, Ray workers, runs recorded before it, or
  call times that do not grow with decode passes) use the call fit, with no report delay:
* Rollout engine calls (call fit): ``b``, the seconds per decode iteration, is the least squares fit
  of ``a + b * decode passes + e * prefill chunk passes`` over the calls (runs recorded before the
  chunked-prefill engine: ``a + b * iterations + c * [the call started groups]``); it is the
  simulator's ``decode_s_per_token`` (a continuous-batching iteration, fixed shapes:
  ``occupancy_slowdown = 0``). The rest of the rollout's busy time (prefill chunks, host work
  between calls) is charged to group starts: ``c_g = (total call seconds - b * total decode passes)
  / groups started``, so the simulated rollout does the measured work. On this CPU a prefill chunk
  delays the decode pass of its iteration, so a start stalls every slot for ``c_g`` in all, and so
  it does in the simulator: ``group_start_pause_s = c_g`` (``group_start_stall_fraction``: that
  time's share of the rollout's busy time). (Charging the same slot-seconds to each sample's own
  slot instead, as for a chunked-prefill engine, over-predicted partially overlapped runs by ~20%.)
* Trainer: the measured mean seconds per mini-batch (fetch, device transfer, update, weight
  publish; the step has fixed shapes, so no per-token term), and the per-step host work after a
  step's last mini-batch (metrics, TensorBoard, logging): the window's wall time the trainer
  spent neither on mini-batches nor waiting for one, per step (``trainer_step_overhead_s``).
  With the engine timeline, the mini-batch seconds split into seconds alone and extra seconds
  while rollout runs (`trainer_contention`; trainer and rollout share the host's cores): the
  simulated trainer costs ``alone`` per mini-batch, plus ``extra`` when it starts while groups
  generate (``trainer_contended_s``).
* Weight sync: publishing is part of the trainer's time; the rollout adopts a version without a
  pause (``weight_sync_s = 0``).
* Lengths: each class's measured response lengths, as a trace the simulator samples from.

Colocated run (``rollout_s``, ``train_s`` per step of `knitjax.runtime.colocated`): every group
of a step starts at once (``slots = B * G``); the batched sampler runs until its longest sample
ends, so ``decode_s_per_token = rollout_s / max_new_tokens``; the trainer costs ``train_s / M``
per mini-batch, and the rest of each step's wall time (host work between steps) is the per-step
overhead.
"""

from __future__ import annotations

import os

import numpy as np

from knitjax.config import Config
from knitjax.sim.engine import simulate
from knitjax.sim.metrics import summarize_result
from knitjax.sim.workload import ClassSpec, Pipeline, Workload

PREDICTED_KEYS = (
  "steps_per_hour",
  "arch_staleness_mean",
  "arch_staleness_p99",
  "arch_staleness_newest_mean",
  "arch_staleness_unclamped_mean",
  "staleness_mean",
  "trainer_idle_fraction",
  "rollout_idle_fraction",
  "quota_violations",
)


def window_start(run: dict, warmup_steps: int) -> float:
  """Wall time (time.time()) the measurement window begins: the end of the warmup steps."""
  t_start = run["timings"]["t_start"] if run["timings"] else 0.0
  return t_start + (run["wall"][warmup_steps - 1] if warmup_steps else 0.0)


def _window_span(run: dict, warmup_steps: int) -> float:
  """Wall seconds from the end of the warmup steps to the end of the last step."""
  wall = run["wall"]
  return float(wall[-1] - (wall[warmup_steps - 1] if warmup_steps else 0.0))


def engine_call_fit(calls: np.ndarray) -> dict:
  """Decode seconds per iteration and group-start seconds from engine calls (module docstring).

  ``calls``: rows ``(end time, seconds, iterations, groups started, live samples[, prefill chunk
  passes, decode passes])``. ``group_start_stall_fraction``: the share of the calls' seconds no
  live sample advanced for a group start (prefill, host work): what the simulator charges as
  group-start pauses.
  """
  dt, starts = calls[:, 1], calls[:, 3]
  if calls.shape[1] >= 7:  # chunked-prefill engine: prefill runs in its own passes
    iters, chunks = calls[:, 6], calls[:, 5]
    x = np.stack([np.ones_like(dt), iters, chunks], 1)
  else:  # runs recorded before: prefill happened at the start of a call
    iters, chunks = calls[:, 2], np.zeros_like(dt)
    x = np.stack([np.ones_like(dt), iters, (starts > 0).astype(np.float64)], 1)
  (_, b, _), *_ = np.linalg.lstsq(x, dt, rcond=None)
  b = max(float(b), 0.0)
  c = max(0.0, (dt.sum() - b * iters.sum()) / max(starts.sum(), 1.0))
  return {
    "decode_s_per_iteration": b,
    "group_start_s": float(c),
    "chunk_passes": int(chunks.sum()),
    "group_start_stall_fraction": float(c * starts.sum() / max(dt.sum(), 1e-12)),
  }


TIMELINE_COLUMNS = 9  # `ContinuousEngine.timeline` rows


def timeline_rows(timeline) -> np.ndarray:
  """An engine call timeline as a [calls, 9] float array."""
  if not len(timeline):  # e.g. a trainer whose engine ran in a rollout host
    return np.zeros((0, TIMELINE_COLUMNS))
  rows = np.asarray(timeline, np.float64)
  rows = rows.reshape(len(rows), -1)
  if rows.shape[1] != TIMELINE_COLUMNS:
    raise ValueError(
      f"an engine call timeline has {TIMELINE_COLUMNS} columns, not {rows.shape[1]} (a 10th "
      "column came from engines with fused prefill, which knitjax no longer has)."
    )
  return rows


def engine_timeline_fit(rows: np.ndarray, *, groups_started: int) -> dict | None:
  """Decode seconds per iteration and the group-start stall from the engine's own call timeline
  (`ContinuousEngine.timeline`), whether host work overlaps the calls or not.

  A call's device seconds are known where it was still running when the host came to collect it
  (it ran from launch to collect end): ``d = a + b * decode passes + e * chunk passes`` is fitted
  on those calls and estimates the others (at most launch to collect begin). The stall is what
  the samples already held waited for: the gaps from a call's end to the next launch while
  samples were held (host work: scoring, storing, admission, placing new groups), plus each
  call's seconds beyond ``b`` x its decode passes (the fixed cost of a call and the prefill
  chunks, which live slots wait for on a device that runs them one after the other).
  ``group_start_s`` charges it to the ``groups_started``. None when fewer than 3 calls were
  running at collect. When the fitted seconds per decode pass are not positive (the calls'
  device time does not grow with their passes: on a CPU shared with the host work and the
  trainer a call's wall time is mostly contention), ``b`` is the seen calls' device seconds per
  decode pass instead, an upper bound (``decode_split="ratio"``).
  """
  launch, begin, end, running, _, dpass, chunks, held, _ = timeline_rows(rows).T
  known = running > 0
  if known.sum() < 3:
    return None
  # A call starts on the device at its launch or when the call ahead of it ends, whichever is
  # later (the call ahead's collect end bounds that).
  after = np.maximum(launch, np.concatenate([[-np.inf], end[:-1]]))
  x = np.stack([np.ones_like(launch), dpass, chunks], 1)
  coef, *_ = np.linalg.lstsq(x[known], (end - after)[known], rcond=None)
  b, split = float(coef[1]), "fit"
  if b <= 0:  # call time does not grow with passes (contention): device seconds per pass instead
    b, split = float((end - after)[known].sum() / max(dpass[known].sum(), 1.0)), "ratio"
    coef = np.array([0.0, b, 0.0])
  estimate = x @ np.array([coef[0], b, coef[2]])
  device, gaps, start = _device_spans(launch, begin, end, known, estimate)
  gaps = gaps[1:] * (held[1:] > 0)
  beyond = np.maximum(device - b * dpass, 0.0)
  stall = float(gaps.sum() + beyond.sum())
  busy = float(device.sum() + gaps.sum())
  # A sample ends, on average, half-way through its call's device time and is handed back when
  # the host collects the call (collect end): the report delay the simulator adds to a group.
  report = max(float(np.mean(end - start - device / 2.0)), 0.0)
  return {
    "decode_s_per_iteration": b,
    "group_start_s": stall / max(groups_started, 1),
    "group_start_stall_fraction": stall / max(busy, 1e-12),
    "host_gap_s": float(gaps.sum()),
    "device_s": float(device.sum()),
    "calls_running_at_collect": float(known.mean()),
    "decode_split": split,
    "report_delay_s": report,
  }


def _device_spans(launch, begin, end, known, estimate) -> tuple[np.ndarray, ...]:
  """Per call, its device seconds, the idle gap before it and its start: it starts at its launch or
  when the call ahead of it ends, whichever is later, and runs to its collect end where it was
  still running then (``known``), else ``estimate`` seconds, at most to its collect begin."""
  device, gaps, start = np.zeros(len(launch)), np.zeros(len(launch)), np.zeros(len(launch))
  free_at = -np.inf
  for n in range(len(launch)):
    start[n] = max(launch[n], free_at)
    gaps[n] = max(launch[n] - free_at, 0.0) if n else 0.0
    span = end[n] - start[n] if known[n] else min(max(estimate[n], 0.0), begin[n] - start[n])
    device[n] = max(span, 0.0)
    free_at = start[n] + device[n]
  return device, gaps, start


def overlap_fraction(windows: np.ndarray, intervals: np.ndarray) -> np.ndarray:
  """Per ``[start, end]`` row of ``windows``, the fraction of it covered by the disjoint
  ``[start, end]`` rows of ``intervals`` (in time order or not); O((windows + intervals) log
  intervals), so whole-run timelines stay cheap."""
  w = np.asarray(windows, np.float64).reshape(-1, 2)
  iv = np.asarray(intervals, np.float64).reshape(-1, 2)
  iv = iv[np.argsort(iv[:, 0])]
  lengths = np.maximum(iv[:, 1] - iv[:, 0], 0.0)
  before = np.concatenate([[0.0], np.cumsum(lengths)])  # covered time before each interval

  def covered_until(t: np.ndarray) -> np.ndarray:
    k = np.searchsorted(iv[:, 0], t, side="right") - 1  # the last interval starting by t
    inside = np.clip(t - iv[np.maximum(k, 0), 0], 0.0, lengths[np.maximum(k, 0)])
    return np.where(k >= 0, before[np.maximum(k, 0)] + inside, 0.0)

  if not len(iv):
    return np.zeros(len(w))
  covered = covered_until(w[:, 1]) - covered_until(w[:, 0])
  return np.clip(covered / np.maximum(w[:, 1] - w[:, 0], 1e-12), 0.0, 1.0)


def trainer_contention(minibatches: np.ndarray, rollout_busy: np.ndarray) -> tuple[float, float]:
  """A mini-batch's seconds alone and the extra seconds when rollout runs throughout it: the
  least squares line ``seconds = alone + extra * overlap`` over ``minibatches`` (rows of ``(end
  time, seconds)``), ``overlap`` the fraction of each mini-batch during which rollout had groups
  generating (``rollout_busy``: disjoint sorted ``[start, end]`` rows). Trainer and rollout
  sharing the same cores (one CPU host) makes ``extra`` > 0; ``extra`` is clamped at 0 and
  ``alone`` keeps the mean when there is no spread to fit on."""
  mb = np.asarray(minibatches, np.float64).reshape(-1, 2)
  mean = float(mb[:, 1].mean()) if len(mb) else 0.0
  if len(mb) < 3 or len(rollout_busy) == 0:
    return mean, 0.0
  x = overlap_fraction(np.stack([mb[:, 0] - mb[:, 1], mb[:, 0]], 1), rollout_busy)
  if np.ptp(x) < 0.1:
    return mean, 0.0
  extra, alone = np.polyfit(x, mb[:, 1], 1)
  if extra <= 0 or alone <= 0:
    return mean, 0.0
  return float(alone), float(extra)


def rollout_busy_intervals(timeline: np.ndarray) -> np.ndarray:
  """From the engine's call timeline, the spans during which rollout was working: each call
  that held samples before its launch or started prompts, from its launch to its collect end
  (the host's work on the call included; idle waits between calls are not)."""
  rows = timeline_rows(timeline)
  busy = (rows[:, 7] + rows[:, 8]) > 0
  return np.stack([rows[:, 0], np.maximum(rows[:, 2], rows[:, 0])], 1)[busy]


def fit_costs(run: dict, *, warmup_steps: int) -> dict:
  """Service times of a disaggregated run over its window (see the module docstring)."""
  t = run["timings"]
  t0 = window_start(run, warmup_steps)
  raw = np.asarray(t["calls"], np.float64)
  calls = raw.reshape(-1, raw.shape[-1] if raw.ndim == 2 else 5)
  calls = calls[calls[:, 0] > t0]
  fit = engine_call_fit(calls)
  dt, starts = calls[:, 1], calls[:, 3]
  timeline = timeline_rows(t.get("engine_calls") or [])
  timeline = timeline[timeline[:, 0] > t0]
  measured = engine_timeline_fit(timeline, groups_started=int(starts.sum()))
  if measured is not None:
    # The engine's own timeline gives the seconds per decode pass (seen on the device, not fitted
    # on loop times that host work overlaps) and the engine's stall; the rest of the rollout's
    # busy time is charged to group starts as in the call fit, so the simulated rollout still
    # does the measured work (host work while no sample is held, e.g. starting a step's groups
    # at depth 0, is on the critical path too).
    b = measured["decode_s_per_iteration"]
    c = max(0.0, (dt.sum() - b * calls[:, 6].sum()) / max(starts.sum(), 1.0))
    fit = {**fit, **measured, "group_start_s": float(c)}
  elif fit["decode_s_per_iteration"] <= 0:  # the call fit found no per-pass time either
    b = float(dt.sum() / max(calls[:, 6].sum() if calls.shape[1] >= 7 else calls[:, 2].sum(), 1))
    fit = {**fit, "decode_s_per_iteration": b, "group_start_s": 0.0}
  mb = np.asarray(t["trainer_minibatch_s"], np.float64).reshape(-1, 2)
  mb = mb[mb[:, 0] > t0]
  window = run["rows"][warmup_steps:]
  idle_s = sum(r["trainer_idle_fraction"] * r["step_s"] for r in window)
  host_s = _window_span(run, warmup_steps) - idle_s - mb[:, 1].sum()
  alone, extra = trainer_contention(mb, rollout_busy_intervals(timeline))
  return {
    "decode_s_per_iteration": fit["decode_s_per_iteration"],
    "group_start_s": fit["group_start_s"],
    "trainer_minibatch_s": float(mb[:, 1].mean()),
    "trainer_alone_s": alone,  # a mini-batch with rollout idle (= the mean without a timeline)
    "trainer_contended_s": extra,  # extra when rollout runs throughout it
    "trainer_step_overhead_s": max(0.0, float(host_s) / len(window)),
    "engine_calls": int(len(calls)),
    "chunk_passes": fit["chunk_passes"],
    "group_start_stall_fraction": fit["group_start_stall_fraction"],
    "stall_measure": "timeline" if measured is not None else "call_fit",
    "timeline_calls": int(len(timeline)),
    "host_gap_s": fit.get("host_gap_s", float("nan")),  # from the timeline (nan: none)
    "device_s": fit.get("device_s", float("nan")),
    "report_delay_s": fit.get("report_delay_s", 0.0),  # from the timeline (0: none)
    "rollout_busy_s": float(dt.sum()),
    "groups_started": int(starts.sum()),
    "slots": int(t["slots"]),
  }


def write_traces(run: dict, directory: str) -> dict[str, str]:
  """Writes each class's measured lengths as a trace file; returns class -> path."""
  out = {}
  for cls, lengths in run["timings"]["lengths"].items():
    path = os.path.join(directory, f"lengths_{cls}.txt")
    np.savetxt(path, np.asarray(lengths, np.int64), fmt="%d")
    out[cls] = path
  return out


def _classes(cfg: Config, traces: dict[str, str], prompt_tokens: dict[str, int]):
  a = cfg.admission
  return tuple(
    ClassSpec(
      name=c,
      quota=q,
      min_per_minibatch=a.min_per_minibatch.get(c, 0),
      max_per_minibatch=a.max_per_minibatch.get(c, 0),
      length_trace=traces[c],
      length_max=cfg.rollout.class_max_new_tokens.get(c, cfg.rollout.max_new_tokens),
      prompt_tokens=prompt_tokens[c],
    )
    for c, q in a.quotas.items()
  )


def disaggregated_workload(
  cfg: Config,
  costs: dict,
  traces: dict[str, str],
  prompt_tokens: dict[str, int],
) -> Workload:
  """The `Workload` of a disaggregated run with the fitted costs (see the module docstring)."""
  return Workload(
    classes=_classes(cfg, traces, prompt_tokens),
    group_size=cfg.rollout.group_size,
    minibatches=cfg.admission.minibatches,
    slots=costs["slots"],
    decode_s_per_token=costs["decode_s_per_iteration"],
    occupancy_slowdown=0.0,
    prefill_s_per_token=0.0,
    group_start_pause_s=costs["group_start_s"],
    weight_sync_s=0.0,
    trainer_s_per_token=0.0,
    trainer_overhead_s=costs.get("trainer_alone_s", costs["trainer_minibatch_s"]),
    trainer_contended_s=costs.get("trainer_contended_s", 0.0),
    trainer_step_overhead_s=costs["trainer_step_overhead_s"],
    report_delay_s=costs.get("report_delay_s", 0.0),
  )


def colocated_costs(run: dict, cfg: Config, *, warmup_steps: int) -> dict:
  """Service times of a colocated run over its window."""
  window = run["rows"][warmup_steps:]
  rollout_s = float(np.mean([r["rollout_s"] for r in window]))
  train_s = float(np.mean([r["train_s"] for r in window]))
  span = _window_span(run, warmup_steps)
  return {
    "decode_s_per_iteration": rollout_s / cfg.rollout.max_new_tokens,
    "group_start_s": 0.0,
    "trainer_minibatch_s": train_s / cfg.admission.minibatches,
    "trainer_step_overhead_s": max(0.0, span / len(window) - rollout_s - train_s),
    "rollout_s_per_step": rollout_s,
    "slots": cfg.admission.groups_per_step * cfg.rollout.group_size,
  }


def pipeline_of(cfg: Config, *, colocated: bool = False) -> Pipeline:
  return Pipeline(
    policy=cfg.admission.policy,
    mode="colocated" if colocated else "disaggregated",
    max_lag_steps=0.0 if colocated else cfg.pipeline.max_lag_steps,
    lag_unit=cfg.pipeline.lag_unit,
    weight_sync=cfg.sync.every,
    adoption=cfg.sync.adoption,
    scheduling="plain",
  )


def predict(w: Workload, p: Pipeline, *, num_steps: int, warmup_steps: int, seeds=(0, 1, 2)):
  """The simulator's metrics for the run, averaged over a few seeds (lengths, tie order)."""
  results = [
    summarize_result(simulate(w, p, num_steps=num_steps, warmup_steps=warmup_steps, seed=s))
    for s in seeds
  ]
  return {k: float(np.mean([r[k] for r in results])) for k in PREDICTED_KEYS}


def rel_error(predicted: float, measured: float) -> float | None:
  """``(predicted - measured) / measured``; 0 when both are 0, None when only measured is."""
  if measured == 0:
    return 0.0 if predicted == 0 else None
  return (predicted - measured) / measured
