"""The (throughput, staleness) frontier over pipeline depth, and comparisons on it.

At a saturated depth Little's law ties mean staleness to the depth whatever the admission policy;
the policy decides how much throughput a depth buys. So policies are compared on the frontier:
``reduction`` is the architectural-staleness cut at matched throughput, ``throughput_gain`` the
throughput ratio at equal depth.
"""

import dataclasses
from collections.abc import Sequence

from knitjax.sim.engine import SimResult, simulate
from knitjax.sim.metrics import summarize_result
from knitjax.sim.workload import Pipeline, Workload

# Metrics kept per frontier point (the full set stays in the per-policy entries).
POINT_KEYS = (
  "steps_per_hour",
  "arch_staleness_mean",
  "arch_staleness_p50",
  "arch_staleness_p99",
  "arch_staleness_max",
  "arch_staleness_newest_mean",
  "arch_staleness_unclamped_mean",
  "staleness_mean",
  "staleness_generating_mean",
  "staleness_waiting_mean",
  "generation_s_mean",
  "trainer_idle_fraction",
  "rollout_idle_fraction",
  "quota_violations",
  "stalls",
)


def depth_grid(minibatches: int, max_depth: float = 2.0) -> list[float]:
  """Depths 0, 1/M, 2/M, ..., max_depth."""
  n = round(max_depth * minibatches)
  return [k / minibatches for k in range(n + 1)]


def run_frontier(
  workload: Workload,
  pipeline: Pipeline,
  depths: Sequence[float],
  *,
  num_steps: int,
  warmup_steps: int,
  seed: int,
) -> tuple[list[dict], dict[float, SimResult]]:
  """Simulates ``pipeline`` at each depth; returns the points and the results by depth."""
  points, results = [], {}
  for d in depths:
    r = simulate(
      workload,
      dataclasses.replace(pipeline, max_lag_steps=d),
      num_steps=num_steps,
      warmup_steps=warmup_steps,
      seed=seed,
    )
    m = summarize_result(r)
    points.append({"max_lag_steps": d, **{k: m[k] for k in POINT_KEYS}})
    results[d] = r
  return points, results


def _at(frontier: Sequence[dict], depth: float) -> dict:
  for p in frontier:
    if abs(p["max_lag_steps"] - depth) < 1e-9:
      return p
  raise ValueError(f"the frontier has no point at max_lag_steps={depth}; add it to the depths.")


# Throughputs within this relative difference are a tie: on a saturated plateau two runs give
# e.g. 5.0000 vs 4.9993 steps/h, and an exact `>=` would call that "no match".
RTOL = 1e-3


def compare(
  baseline: Sequence[dict],
  candidate: Sequence[dict],
  *,
  depth: float = 1.0,
  key: str = "arch_staleness_mean",
  rtol: float = RTOL,
) -> dict:
  """Candidate vs baseline frontier (e.g. `minibatch` vs `train_batch`).

  Throughputs and staleness values within ``rtol`` (relative) of each other count as equal.

  Returns:
    ``reduction``: 1 - key(candidate at the shallowest depth whose throughput is at least the
    baseline's at ``depth``) / key(baseline at ``depth``), None when no candidate depth matches
    the throughput or the baseline's value is 0; ``reduction_interpolated``: the same with the
    candidate's staleness interpolated linearly along its frontier to exactly the baseline's
    throughput (the depth grid is coarse); ``reduction_equal_config``: 1 - key(candidate) /
    key(baseline), both at ``depth`` (the same configuration, whatever the throughputs);
    ``matched_depth``; ``throughput_gain``: throughput ratio at ``depth``;
    ``staler_at_matched_throughput``: baseline depths where the candidate's shallowest point of
    at least that throughput is staler; ``dominates``: at every common depth the candidate has
    at least the baseline's throughput, and that list is empty.
  """
  if not 0 <= rtol < 1:
    raise ValueError(f"rtol={rtol!r}; accepted: 0 <= rtol < 1.")
  base = _at(baseline, depth)
  cand = _at(candidate, depth)
  matched = _matched(candidate, base["steps_per_hour"], rtol)
  reduction = interpolated = equal_config = None
  if base[key] > 0:
    equal_config = 1.0 - cand[key] / base[key]
  if matched is not None and base[key] > 0:
    reduction = 1.0 - matched[key] / base[key]
    at = _interpolate(candidate, base["steps_per_hour"], key, rtol)
    interpolated = None if at is None else 1.0 - at / base[key]
  margins, staler = [], []
  for b in baseline:
    c = next((p for p in candidate if abs(p["max_lag_steps"] - b["max_lag_steps"]) < 1e-9), None)
    if c is not None:
      margins.append(c["steps_per_hour"] / b["steps_per_hour"] - 1.0)
    m = _matched(candidate, b["steps_per_hour"], rtol)
    if m is not None and _greater(m[key], b[key], rtol):
      staler.append(b["max_lag_steps"])
  return {
    "reduction": reduction,
    "reduction_interpolated": interpolated,
    "reduction_equal_config": equal_config,
    "matched_depth": None if matched is None else matched["max_lag_steps"],
    "baseline_depth": depth,
    "baseline": {k: base[k] for k in ("steps_per_hour", key)},
    "matched": None if matched is None else {k: matched[k] for k in ("steps_per_hour", key)},
    "throughput_gain": cand["steps_per_hour"] / base["steps_per_hour"],
    "min_throughput_margin": min(margins) if margins else None,
    "staler_at_matched_throughput": staler,
    "dominates": bool(margins) and min(margins) >= -rtol and not staler,
    "rtol": rtol,
  }


def _greater(a: float, b: float, rtol: float) -> bool:
  """``a > b`` by more than ``rtol`` of the larger magnitude (ties are not greater)."""
  return a - b > rtol * max(abs(a), abs(b))


def _matched(frontier: Sequence[dict], steps_per_hour: float, rtol: float = RTOL) -> dict | None:
  """The shallowest point with at least ``steps_per_hour`` (within ``rtol``)."""
  for p in sorted(frontier, key=lambda p: p["max_lag_steps"]):
    if p["steps_per_hour"] >= steps_per_hour * (1.0 - rtol):
      return p
  return None


def _interpolate(
  frontier: Sequence[dict], steps_per_hour: float, key: str, rtol: float = RTOL
) -> float | None:
  """``key`` at exactly ``steps_per_hour``, linear between the frontier points around it (a
  target within ``rtol`` above the frontier's highest throughput is that point's)."""
  pts = sorted(frontier, key=lambda p: p["max_lag_steps"])
  top = max(pts, key=lambda p: p["steps_per_hour"]) if pts else None
  if top is not None and top["steps_per_hour"] < steps_per_hour <= top["steps_per_hour"] / (
    1.0 - rtol
  ):
    steps_per_hour = top["steps_per_hour"]
  for lo, hi in zip(pts, pts[1:], strict=False):
    x0, x1 = lo["steps_per_hour"], hi["steps_per_hour"]
    if x0 <= steps_per_hour <= x1 and x1 > x0:
      a = (steps_per_hour - x0) / (x1 - x0)
      return lo[key] + a * (hi[key] - lo[key])
  first = pts[0] if pts else None
  if first is not None and first["steps_per_hour"] >= steps_per_hour:
    return first[key]
  return None
