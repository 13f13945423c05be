"""Staleness accounting for consumed trajectories.

For each consumed trajectory (one sample of a group):

- staleness ``s = consume version - gen version``;
- colocated gap ``j``: index (0-based) of its mini-batch within the train step, i.e. the staleness
  colocated synchronous execution would have (mini-batch ``j`` of a step is computed with the
  version reached after ``j`` updates on data generated before the step);
- architectural staleness ``max(0, s - j)``: the extra gap caused by disaggregated pipelining.

The gen version is the oldest rollout version a trajectory used. With partial rollout (weights
changing mid-generation) the newest version is recorded too and reported under ``*_newest_*``.

``staleness`` and ``summarize`` are vectorised NumPy (the simulator calls them on millions of
trajectories); ``StalenessTracker`` turns released mini-batches into per-step metrics.
"""

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
  from knitjax.transfer.admission import MiniBatch


def _as_int(name: str, x) -> np.ndarray:
  a = np.asarray(x)
  if a.dtype.kind not in "iu":
    raise ValueError(f"{name} has dtype {a.dtype}; accepted: integers (policy versions).")
  return a.astype(np.int64, copy=False)


def staleness(gen_version, consume_version, minibatch_index) -> tuple[np.ndarray, np.ndarray]:
  """Staleness and architectural staleness of trajectories (broadcasting int arrays or ints).

  Args:
    gen_version: gen version of each trajectory.
    consume_version: consume version of each trajectory (of its mini-batch).
    minibatch_index: colocated gap ``j``, the mini-batch's index within its train step.

  Returns:
    ``(staleness, architectural staleness)`` as int64 arrays of the broadcast shape.

  Raises:
    ValueError: non-integer input, ``j < 0``, or a trajectory consumed before its gen version.
  """
  gen = _as_int("gen_version", gen_version)
  cons = _as_int("consume_version", consume_version)
  j = _as_int("minibatch_index", minibatch_index)
  gen, cons, j = np.broadcast_arrays(gen, cons, j)  # views, no copies
  s = cons - gen
  if s.size and s.min() < 0:
    k = np.unravel_index(np.argmin(s), s.shape)
    g, c = gen[k], cons[k]
    raise ValueError(
      f"consume_version {c} is older than gen_version {g} for {int((s < 0).sum())} trajectories; "
      "accepted: consume_version >= gen_version."
    )
  if j.size and j.min() < 0:
    raise ValueError(f"minibatch_index has {j.min()}; accepted: mini-batch indices >= 0.")
  return s, np.maximum(s - j, 0)


def summarize(values, prefix: str) -> dict[str, float]:
  """Mean, median, 99th percentile, max and count of ``values`` under ``prefix_*`` keys.

  Percentiles interpolate linearly (NumPy's default). With no values the count is 0 and the
  statistics are NaN (not 0, which would read as perfectly fresh data).
  """
  v = np.asarray(values, np.float64).ravel()
  if v.size == 0:
    stats = dict.fromkeys(("mean", "p50", "p99", "max"), math.nan)
  else:
    p50, p99 = np.percentile(v, [50, 99])
    stats = {"mean": v.mean(), "p50": p50, "p99": p99, "max": v.max()}
  stats["count"] = v.size
  return {f"{prefix}_{k}": float(x) for k, x in stats.items()}


class StalenessTracker:
  """Collects the staleness of consumed trajectories per train step.

  ``record`` each mini-batch when it is consumed; ``step_metrics`` summarises a step and forgets
  it, so memory stays bounded by the steps in flight.

  Args:
    report_newest: always report the newest-version convention; by default it is reported for
      a step only when some trajectory's newest version differs from its gen version.
  """

  def __init__(self, report_newest: bool = False):
    self.report_newest = report_newest
    # step -> list of (mini-batch index, consume version, gen versions, newest versions).
    self._steps: dict[int, list[tuple[int, int, np.ndarray, np.ndarray]]] = {}

  def record(self, minibatch: "MiniBatch", consume_version: int) -> None:
    """Records every trajectory of a consumed mini-batch (``num_samples`` per group).

    Raises:
      ValueError: the mini-batch was recorded already, or is consumed before its gen versions.
    """
    step, index = int(minibatch.step), int(minibatch.index)
    chunks = self._steps.setdefault(step, [])
    if any(c[0] == index for c in chunks):
      raise ValueError(f"mini-batch {index} of step {step} was recorded already.")
    counts = [g.num_samples for g in minibatch.groups]
    gen = np.repeat(np.array([g.gen_version for g in minibatch.groups], np.int64), counts)
    newest = np.repeat(
      np.array(
        [
          g.gen_version if g.gen_version_newest is None else g.gen_version_newest
          for g in minibatch.groups
        ],
        np.int64,
      ),
      counts,
    )
    staleness(gen, consume_version, index)  # fail fast on an impossible record
    chunks.append((index, int(consume_version), gen, newest))

  def steps(self) -> list[int]:
    """Steps with records not yet summarised, in order."""
    return sorted(self._steps)

  def step_metrics(self, step: int) -> dict[str, float]:
    """Summarises the staleness of a step's trajectories and forgets the step.

    Returns:
      ``staleness_*`` and ``arch_staleness_*`` (mean, p50, p99, max, count, see ``summarize``),
      ``arch_staleness_unclamped_mean`` (mean of ``s - j`` without the clamp at 0),
      ``staleness_newest_*`` and ``arch_staleness_newest_*`` when some newest version differs
      from its gen version (or ``report_newest``), and ``minibatches`` recorded. A step never
      recorded gives count 0 and NaN statistics.
    """
    chunks = self._steps.pop(step, [])
    if chunks:
      j = np.concatenate([np.full(len(c[2]), c[0], np.int64) for c in chunks])
      cons = np.concatenate([np.full(len(c[2]), c[1], np.int64) for c in chunks])
      gen = np.concatenate([c[2] for c in chunks])
      newest = np.concatenate([c[3] for c in chunks])
    else:
      j = cons = gen = newest = np.zeros(0, np.int64)
    s, arch = staleness(gen, cons, j)
    out = {**summarize(s, "staleness"), **summarize(arch, "arch_staleness")}
    # Without the clamp: negative where trajectories are fresher than colocated would have them.
    out["arch_staleness_unclamped_mean"] = float((s - j).mean()) if s.size else float("nan")
    if self.report_newest or (newest != gen).any():
      s_new, arch_new = staleness(newest, cons, j)
      out.update(summarize(s_new, "staleness_newest"))
      out.update(summarize(arch_new, "arch_staleness_newest"))
    out["minibatches"] = float(len(chunks))
    return out

  def state_dict(self) -> dict[str, Any]:
    """Plain-Python state (lists of ints) of the steps not yet summarised, for checkpoints."""
    return {
      "records": [
        {
          "step": step,
          "index": index,
          "consume_version": cons,
          "gen_version": gen.tolist(),
          "gen_version_newest": newest.tolist(),
        }
        for step, chunks in sorted(self._steps.items())
        for index, cons, gen, newest in chunks
      ]
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Replaces the tracker's records with those of ``state_dict()``."""
    steps: dict[int, list] = {}
    for r in state["records"]:
      gen = np.asarray(r["gen_version"], np.int64)
      newest = np.asarray(r["gen_version_newest"], np.int64)
      if gen.shape != newest.shape:
        raise ValueError(
          f"staleness record of step {r['step']} mini-batch {r['index']} has "
          f"{gen.size} gen versions but {newest.size} newest ones; accepted: equal counts."
        )
      steps.setdefault(int(r["step"]), []).append(
        (int(r["index"]), int(r["consume_version"]), gen, newest)
      )
    self._steps = steps
