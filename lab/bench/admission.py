"""Admission benchmark: time per `offer` for each policy on one random workload.

Besides the time per offer it reports what each policy did with the same arrivals: released
steps, groups still pending at the end, violations, stalls, and the admission delay (offers
between a group's arrival and the release of its mini-batch).
"""

import gc
import time

import ml_collections
import numpy as np

from knitjax.transfer.admission import POLICIES, AdmissionIndex
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.quota import QuotaSpec
from lab.bench.report import format_table, write_json


def make_spec(
  num_classes: int,
  minibatches: int,
  groups_per_minibatch: int,
  min_bound_fraction: float,
  max_bound_fraction: float,
  rng: np.random.Generator,
) -> QuotaSpec:
  """Random quotas (1 + log-normal shares) with some tight per-mini-batch bounds."""
  total = minibatches * groups_per_minibatch
  if total < num_classes:
    raise ValueError(
      f"admission bench: {minibatches} x {groups_per_minibatch} = {total} groups per step "
      f"cannot give each of num_classes={num_classes} classes a group."
    )
  weights = rng.lognormal(0.0, 1.0, num_classes)
  share = weights / weights.sum() * (total - num_classes)
  quotas = np.floor(share).astype(int)
  rest = total - num_classes - quotas.sum()
  quotas[np.argsort(share - quotas)[::-1][:rest]] += 1  # largest remainder
  quotas += 1
  names = [f"c{i:02d}" for i in range(num_classes)]
  big = [i for i in range(num_classes) if quotas[i] >= minibatches]
  lows = rng.choice(big, int(len(big) * min_bound_fraction), replace=False) if big else []
  highs = rng.choice(num_classes, int(num_classes * max_bound_fraction), replace=False)
  return QuotaSpec(
    {n: int(q) for n, q in zip(names, quotas, strict=True)},
    minibatches,
    {names[i]: int(quotas[i]) // minibatches for i in lows},
    {names[i]: -(-int(quotas[i]) // minibatches) + 1 for i in highs},
  )


def make_groups(
  spec: QuotaSpec, num_groups: int, arrivals: str, rng: np.random.Generator
) -> list[GroupMeta]:
  """Groups in a random arrival order.

  ``arrivals="steps"``: each run of `B` arrivals is one step's quotas in a random order (supply
  meets demand, so the exact check decides nearly every offer). ``"iid"``: classes drawn
  independently in proportion to the quotas (backlogs of some classes grow).
  """
  classes = spec.classes
  quotas = np.array([spec.class_quotas[c] for c in classes])
  if arrivals == "steps":
    one_step = np.repeat(np.arange(len(classes)), quotas)
    steps = -(-num_groups // one_step.size)
    draws = np.concatenate([rng.permutation(one_step) for _ in range(steps)])[:num_groups]
  elif arrivals == "iid":
    draws = rng.choice(len(classes), num_groups, p=quotas / quotas.sum())
  else:
    raise ValueError(f"admission bench: arrivals={arrivals!r}; use 'steps' or 'iid'.")
  return [
    GroupMeta(
      group_id=i,
      cls=classes[c],
      gen_version=0,
      num_samples=1,
      prompt_tokens=(16,),
      response_tokens=(64,),
      reward_std=1.0,
    )
    for i, c in enumerate(draws)
  ]


def time_policy(spec: QuotaSpec, policy: str, groups: list[GroupMeta]) -> dict:
  """Offers every group once; returns per-offer times and what the policy released."""
  index = AdmissionIndex(spec, policy)
  times = np.empty(len(groups), np.int64)
  release_at = {}
  clock = time.perf_counter_ns
  gc_was_enabled = gc.isenabled()
  gc.disable()  # as timeit does: collector pauses are not the index's cost
  try:
    for i, g in enumerate(groups):
      t0 = clock()
      released = index.offer(g)
      times[i] = clock() - t0
      for mb in released:
        for h in mb.groups:
          release_at[h.group_id] = i
  finally:
    if gc_was_enabled:
      gc.enable()
  delay = np.array([release_at[gid] - gid for gid in release_at], float)
  return {"times_us": times / 1e3, "delay": delay, "stats": index.stats()}


# Integer fields and the least value each accepts.
AT_LEAST = {
  "num_classes": 1,
  "minibatches": 1,
  "groups_per_minibatch": 1,
  "num_groups": 1,
  "repeats": 1,
  "seed": 0,
}


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError (one sentence naming the field and what is accepted) for a bad count."""
  for name, least in AT_LEAST.items():
    value = config[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
      raise ValueError(
        f"admission bench: config.{name}={value!r} is not accepted; give an integer >= {least}."
      )
  for name in ("min_bound_fraction", "max_bound_fraction"):
    if not 0.0 <= config[name] <= 1.0:
      raise ValueError(
        f"admission bench: config.{name}={config[name]!r} is not accepted; give a fraction in "
        "[0, 1]."
      )


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Runs the benchmark; writes ``workdir/admission.json`` and ``admission.png``."""
  check_config(config)
  policies = tuple(config.policies)
  for p in policies:
    if p not in POLICIES:
      raise ValueError(f"admission bench: config.policies holds {p!r}; choose from {POLICIES}.")
  rng = np.random.default_rng(config.seed)
  spec = make_spec(
    config.num_classes,
    config.minibatches,
    config.groups_per_minibatch,
    config.min_bound_fraction,
    config.max_bound_fraction,
    rng,
  )
  groups = make_groups(spec, config.num_groups, config.arrivals, rng)
  results, rows, curves = {}, [], {}
  for policy in policies:
    runs = [time_policy(spec, policy, groups) for _ in range(config.repeats)]
    times = np.concatenate([r["times_us"] for r in runs])
    stats, delay = runs[-1]["stats"], runs[-1]["delay"]
    results[policy] = {
      "median_us": float(np.median(times)),
      "p99_us": float(np.percentile(times, 99)),
      "p999_us": float(np.percentile(times, 99.9)),
      "mean_us": float(times.mean()),
      "max_us": float(times.max()),
      "median_us_per_repeat": [float(np.median(r["times_us"])) for r in runs],
      "released_steps": stats["released_steps"],
      "released_groups": stats["released_groups"],
      "pending_at_end": stats["pending"],
      "quota_violations": stats["quota_violations"],
      "bound_violations": stats["bound_violations"],
      "stalls": stats["stalls"],
      "checks_per_offer": stats["checks"] / len(groups),
      "admission_delay_offers_mean": float(delay.mean()) if delay.size else None,
      "admission_delay_offers_p50": float(np.median(delay)) if delay.size else None,
    }
    rows.append(
      {
        "policy": policy,
        **{k: v for k, v in results[policy].items() if k != "median_us_per_repeat"},
      }
    )
    curves[policy] = (np.sort(times), delay)
  result = {
    "workload": {
      "num_classes": config.num_classes,
      "minibatches": config.minibatches,
      "groups_per_minibatch": config.groups_per_minibatch,
      "groups_per_step": spec.groups_per_step,
      "num_groups": config.num_groups,
      "classes_with_min": len(spec.min_per_minibatch),
      "classes_with_max": len(spec.max_per_minibatch),
      "repeats": config.repeats,
      "seed": config.seed,
      "arrivals": config.arrivals,
    },
    "results": results,
    "goal_median_us": config.goal_median_us,
    "goal_met": (
      results["minibatch"]["median_us"] <= config.goal_median_us if "minibatch" in results else None
    ),
  }
  write_json(workdir, "admission", result)
  _plot(curves, f"{workdir}/admission.png")
  print(
    format_table(
      rows,
      [
        "policy",
        "median_us",
        "p99_us",
        "released_steps",
        "pending_at_end",
        "quota_violations",
        "bound_violations",
        "stalls",
        "checks_per_offer",
        "admission_delay_offers_mean",
      ],
    )
  )
  return result


def _plot(curves: dict, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_t, ax_d) = plt.subplots(1, 2, figsize=(10, 4))
  for policy, (times, delay) in curves.items():
    ax_t.plot(times, np.linspace(0, 1, times.size), label=policy)
    if delay.size:
      d = np.sort(delay)
      ax_d.plot(d, np.linspace(0, 1, d.size), label=policy)
  ax_t.set(xscale="log", xlabel="microseconds per offer", ylabel="fraction of offers")
  ax_d.set(xlabel="admission delay (offers from arrival to release)", ylabel="fraction of groups")
  for ax in (ax_t, ax_d):
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
