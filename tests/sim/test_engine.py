"""The event loop on the tiny preset: conservation, Little's law, determinism, policy invariants."""

import dataclasses

import numpy as np
import pytest

from knitjax.sim.engine import CONSUMED, REJECTED, simulate
from knitjax.sim.metrics import counts, littles_law, summarize_result
from knitjax.sim.workload import Pipeline


def _run(w, steps=30, seed=0, **pipeline):
  return simulate(w, Pipeline(**pipeline), num_steps=steps, warmup_steps=3, seed=seed)


@pytest.mark.parametrize("policy", ["train_batch", "minibatch", "greedy"])
@pytest.mark.parametrize("scheduling", ["plain", "admission_aware"])
def test_every_generated_group_is_consumed_rejected_or_pending(make_tiny, policy, scheduling):
  w = make_tiny(reject_a=0.2, reject_b=0.1)
  r = _run(w, policy=policy, scheduling=scheduling, max_lag_steps=0.5)
  n = counts(r)
  assert n["completed"] == n["consumed"] + n["rejected"] + n["pending"] + n["queued"]
  assert n["started"] == n["completed"] + n["generating"]
  stats = r.index_stats
  assert stats["offered"] == n["completed"]
  assert stats["rejected"] == n["rejected"] > 0
  assert stats["pending"] == n["pending"]
  assert stats["released_groups"] == n["consumed"] + n["queued"]
  # Each consumed group is consumed once, in whole mini-batches of B/M groups.
  assert len(set(r.consumed_id.tolist())) == r.consumed_id.size == n["consumed"]
  assert n["consumed"] == 30 * w.groups_per_step
  assert (r.outcome[r.consumed_id] == CONSUMED).all()
  assert np.isnan(r.t_depart[r.outcome < CONSUMED]).all()
  assert (r.t_depart[r.outcome == REJECTED] == r.t_complete[r.outcome == REJECTED]).all()


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.5])
def test_littles_law_holds_on_the_simulated_queue(make_tiny, depth):
  r = _run(make_tiny(), steps=60, max_lag_steps=depth)
  law = littles_law(r)
  assert law["littles_L"] > 0
  assert law["littles_rel_error"] < 0.05, law


def test_same_seed_same_result_other_seed_differs(make_tiny):
  w = make_tiny(reject_a=0.2)
  a, b = _run(w, seed=3), _run(w, seed=3)
  for f in dataclasses.fields(a):
    x, y = getattr(a, f.name), getattr(b, f.name)
    if isinstance(x, np.ndarray):
      np.testing.assert_array_equal(x, y, err_msg=f.name)
    elif f.name != "wall_s":
      assert x == y, f.name
  c = _run(w, seed=4)
  assert c.t_end != a.t_end


def test_colocated_has_zero_architectural_staleness(make_tiny):
  r = _run(make_tiny(), mode="colocated", policy="train_batch", max_lag_steps=0.0)
  m = summarize_result(r)
  assert m["arch_staleness_max"] == 0
  # Colocated staleness is exactly the mini-batch index j: mean (M - 1) / 2.
  assert m["staleness_mean"] == pytest.approx(0.5)
  # Turns: while the trainer computes, no group generates, so the busy times add up.
  assert m["trainer_idle_fraction"] > 0.3 and m["rollout_idle_fraction"] > 0.3


def test_depth_bound_limits_groups_started_ahead_of_the_trainer(make_tiny):
  w = make_tiny()
  depth = 0.5
  r = _run(w, policy="minibatch", max_lag_steps=depth)
  # No rejections and weights published every mini-batch: a group's gen version is the trainer
  # version at its start, so the i-th start (0-based) needs i < B * (v // M + 1 + depth).
  i = np.arange(r.gen_version.size)
  bound = w.groups_per_step * (r.gen_version // w.minibatches + 1 + depth)
  assert (i < bound).all()
  assert (i + 1 == bound).any()  # the bound is reached, not just respected


def test_minibatch_lag_unit_returns_capacity_per_consumed_minibatch(make_tiny):
  w = make_tiny()
  depth = 0.5
  B, M = w.groups_per_step, w.minibatches
  r = _run(w, policy="minibatch", max_lag_steps=depth, lag_unit="minibatch")
  i = np.arange(r.gen_version.size)
  # Version-granular: the i-th start needs i < B + (B / M) * v + depth * B.
  bound = B + (B // M) * r.gen_version + depth * B
  assert (i < bound).all()
  assert (i + 1 == bound).any()
  # Some group started mid-step beyond what the per-step bound allows at its version.
  step_bound = B * (r.gen_version // M + 1 + depth)
  assert (i >= step_bound).any()
  # Capacity back sooner: at equal depth no staler, and no quota broken.
  step = summarize_result(_run(w, policy="minibatch", max_lag_steps=depth))
  m = summarize_result(r)
  assert m["quota_violations"] == 0
  assert m["steps_per_hour"] >= step["steps_per_hour"] * 0.999


def test_minibatch_never_violates_quotas_greedy_does(make_tiny):
  w = make_tiny()
  for depth in (0.0, 1.0, 2.0):
    m = summarize_result(_run(w, policy="minibatch", max_lag_steps=depth))
    assert m["quota_violations"] == 0 and m["stalls"] == 0
  g = summarize_result(_run(w, policy="greedy", max_lag_steps=1.0))
  assert g["quota_violations"] > 0


def test_step_sync_and_mid_generation_adoption_change_staleness_as_expected(make_tiny):
  w = make_tiny()
  per_mb = summarize_result(_run(w, max_lag_steps=1.0))
  per_step = summarize_result(_run(w, max_lag_steps=1.0, weight_sync="step"))
  assert per_step["staleness_mean"] > per_mb["staleness_mean"]
  mid = _run(w, max_lag_steps=1.0, adoption="mid_generation")
  gid = mid.consumed_id
  assert (mid.gen_version_newest[gid] >= mid.gen_version[gid]).all()
  assert (mid.gen_version_newest[gid] > mid.gen_version[gid]).any()
  m = summarize_result(mid)
  assert m["arch_staleness_newest_mean"] < m["arch_staleness_mean"]
  # The oldest convention is the same as without partial rollout (same lengths, same starts).
  assert m["arch_staleness_mean"] == pytest.approx(per_mb["arch_staleness_mean"])


def _percentile(xs, q):
  """Linear-interpolation percentile (NumPy's default), in plain Python."""
  xs = sorted(xs)
  pos = q / 100 * (len(xs) - 1)
  lo = int(pos)
  hi = min(lo + 1, len(xs) - 1)
  return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])


def test_staleness_metrics_match_a_recount_of_the_consume_log(make_tiny):
  """Staleness recomputed by hand from the consume log (not by `staleness()`)."""
  w = make_tiny()
  r = _run(w, max_lag_steps=1.0)
  m = summarize_result(r)
  s, arch, unclamped = [], [], []
  for k, gid in enumerate(r.consumed_id.tolist()):
    # The k-th consumed group sits in the run's mini-batch k // (B/M); with weight_sync=minibatch
    # one version is published per mini-batch, so that mini-batch is consumed at version mb.
    mb = k // w.groups_per_minibatch
    step, j = divmod(mb, w.minibatches)
    assert (r.consumed_step[k], r.consumed_index[k], r.consume_version[k]) == (step, j, mb), k
    if step >= r.warmup_steps:
      gap = mb - int(r.gen_version[gid])
      s += [gap] * w.group_size  # every sample of the group has its group's versions
      arch += [max(0, gap - j)] * w.group_size
      unclamped += [gap - j] * w.group_size
  assert max(arch) > 0 and arch != s  # the window has pipelining staleness and the j-cut matters
  for prefix, xs in (("staleness", s), ("arch_staleness", arch)):
    assert m[f"{prefix}_count"] == len(xs) == (30 - 3) * w.groups_per_step * w.group_size
    assert m[f"{prefix}_mean"] == pytest.approx(sum(xs) / len(xs)), prefix
    assert m[f"{prefix}_max"] == max(xs), prefix
    assert m[f"{prefix}_p50"] == pytest.approx(_percentile(xs, 50)), prefix
    assert m[f"{prefix}_p99"] == pytest.approx(_percentile(xs, 99)), prefix
  # Without mid-generation adoption the newest version is the gen version.
  assert m["arch_staleness_newest_mean"] == pytest.approx(sum(arch) / len(arch))
  assert m["arch_staleness_unclamped_mean"] == pytest.approx(sum(unclamped) / len(unclamped))
  assert m["staleness_generating_mean"] + m["staleness_waiting_mean"] == pytest.approx(
    sum(s) / len(s)
  )


def test_per_step_trainer_overhead_delays_the_next_minibatch(make_tiny):
  """A trainer-bound colocated run: each step costs its mini-batches plus the per-step hold, and
  the hold counts as trainer busy time; conservation and the version count are unchanged."""
  w = make_tiny()
  base = _run(w, mode="colocated", policy="train_batch")
  held = _run(
    dataclasses.replace(w, trainer_step_overhead_s=5.0), mode="colocated", policy="train_batch"
  )
  steps = base.num_steps - base.warmup_steps
  # Colocated turns: the hold sits between the last mini-batch and the next step's rollout,
  # so every step in the window is longer by exactly the hold.
  span = lambda r: r.t_end - r.t_window_start
  assert span(held) - span(base) == pytest.approx(5.0 * steps, rel=0.05)
  assert held.trainer_busy_s - base.trainer_busy_s == pytest.approx(5.0 * steps, rel=0.05)
  assert counts(held)["consumed"] == counts(base)["consumed"]


def test_group_starts_that_stall_the_pool_delay_every_slot(make_tiny):
  """With ``group_start_pause_s`` each start stops the token clock for everyone: the run takes
  longer and the stall is not counted as weight sync."""
  w = dataclasses.replace(make_tiny(), weight_sync_s=0.0)
  base = _run(w, max_lag_steps=0.5)
  stalled = _run(dataclasses.replace(w, group_start_pause_s=0.5), max_lag_steps=0.5)
  assert stalled.sync_pause_s == base.sync_pause_s == 0.0
  assert stalled.t_end > base.t_end
  # Every completed group took at least one stall (its own start) on top of its decoding.
  done = ~np.isnan(stalled.t_complete)
  assert (stalled.t_complete[done] - stalled.t_start[done] >= 0.5 - 1e-9).all()


def test_bad_arguments_raise_one_clear_sentence(make_tiny):
  with pytest.raises(ValueError, match="warmup_steps"):
    simulate(make_tiny(), Pipeline(), num_steps=3, warmup_steps=3)
  with pytest.raises(ValueError, match="multiple of 1/M"):
    simulate(make_tiny(), Pipeline(max_lag_steps=0.3), num_steps=3)


def test_a_report_delay_offers_each_group_later_and_keeps_every_group(make_tiny):
  """With ``report_delay_s`` a finished group reaches admission that much later (the engine hands
  samples back at call boundaries): the first offer moves by exactly the delay, staleness does
  not fall, and every group is still consumed, rejected, queued, pending or generating."""
  w = make_tiny(reject_a=0.2)
  base = _run(w, policy="minibatch", max_lag_steps=0.5)
  late = _run(dataclasses.replace(w, report_delay_s=2.0), policy="minibatch", max_lag_steps=0.5)
  first = int(np.nanargmin(base.t_complete))
  assert int(np.nanargmin(late.t_complete)) == first  # identical until the first offer
  assert late.t_complete[first] == pytest.approx(base.t_complete[first] + 2.0)
  n = counts(late)
  assert n["completed"] == n["consumed"] + n["rejected"] + n["pending"] + n["queued"]
  assert n["started"] == n["completed"] + n["generating"]
  assert n["consumed"] == 30 * w.groups_per_step
  assert summarize_result(late)["staleness_mean"] >= summarize_result(base)["staleness_mean"]


def test_a_trainer_slowed_by_rollout_trains_fewer_versions_while_groups_generate(make_tiny):
  """With ``trainer_contended_s`` a mini-batch started while groups generate costs that much
  more (trainer and rollout on the same cores): fewer versions pass during a group's
  generation, the run is slower, and every group is still accounted for."""
  w = make_tiny(reject_a=0.2)
  base = _run(w, policy="minibatch", max_lag_steps=0.5)
  slow = dataclasses.replace(w, trainer_contended_s=w.trainer_overhead_s)
  shared = _run(slow, policy="minibatch", max_lag_steps=0.5)
  for r in (base, shared):
    n = counts(r)
    assert n["completed"] == n["consumed"] + n["rejected"] + n["pending"] + n["queued"]
    assert n["started"] == n["completed"] + n["generating"]
    assert n["consumed"] == 30 * w.groups_per_step
  assert shared.t_end > base.t_end

  def versions_while_generating(r):
    done = r.version_complete >= 0
    return np.mean((r.version_complete - r.gen_version)[done])

  assert versions_while_generating(shared) < versions_while_generating(base)
