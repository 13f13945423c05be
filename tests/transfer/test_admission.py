"""Admission index and its feasibility check, against brute-force oracles on small instances."""

import collections
import functools
import itertools
import json
import random

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from knitjax.transfer.admission import POLICIES, AdmissionIndex, MiniBatch
from knitjax.transfer.feasibility import FeasibilityTracker, balanced_split, completion_feasible
from knitjax.transfer.group import GroupMeta
from knitjax.transfer.quota import QuotaSpec

NAMES = ("a", "b", "c")
PROPS = settings(max_examples=150, deadline=None)


def group(i, cls, *, std=1.0):
  return GroupMeta(
    group_id=i,
    cls=cls,
    gen_version=0,
    num_samples=2,
    prompt_tokens=(3, 3),
    response_tokens=(i % 5, 1),
    reward_std=std,
  )


# ---- brute-force oracle -------------------------------------------------------------------------


def vectors(total, lows, highs):
  """All integer vectors with lows <= v <= highs and sum(v) == total."""
  ranges = [range(lo, hi + 1) for lo, hi in zip(lows, highs, strict=True)]
  return [v for v in itertools.product(*ranges) if sum(v) == total]


@functools.cache
def oracle(spec_key, open_counts, remaining, empty):
  """Whether the step completes, by enumerating every filling of every mini-batch."""
  quotas, lows, highs, size = spec_key
  free = size - sum(open_counts)
  if free < 0 or any(r < 0 for r in remaining):
    return False

  @functools.cache
  def fill(rem, k):
    if k == 0:
      return not any(rem)
    return any(
      fill(tuple(r - w for r, w in zip(rem, v, strict=True)), k - 1)
      for v in vectors(size, lows, [min(h, r) for h, r in zip(highs, rem, strict=True)])
    )

  zs = vectors(
    free,
    [max(0, lo - x) for lo, x in zip(lows, open_counts, strict=True)],
    [min(hi - x, r) for hi, x, r in zip(highs, open_counts, remaining, strict=True)],
  )
  return any(fill(tuple(r - z for r, z in zip(remaining, zz, strict=True)), empty) for zz in zs)


def key(spec):
  cs = spec.classes
  return (
    tuple(spec.class_quotas[c] for c in cs),
    tuple(spec.min_of(c) for c in cs),
    tuple(spec.max_of(c) for c in cs),
    spec.groups_per_minibatch,
  )


def step_state(spec, idx, released):
  """(open counts, remaining quota, empty mini-batches) of the index, from its public API."""
  cs = spec.classes
  placed = collections.Counter(g.cls for mb in released if mb.step == idx.step for g in mb.groups)
  opened = collections.Counter(g.cls for g in idx.open_groups())
  placed.update(opened)
  return (
    tuple(opened[c] for c in cs),
    tuple(spec.class_quotas[c] - placed[c] for c in cs),
    spec.minibatches - 1 - idx.minibatch_index,
  )


def plus(counts, remaining, c):
  counts, remaining = list(counts), list(remaining)
  counts[c] += 1
  remaining[c] -= 1
  return tuple(counts), tuple(remaining)


# ---- strategies ---------------------------------------------------------------------------------


@st.composite
def specs(draw):
  """Small valid quota specs (<= 3 classes, <= 4 mini-batches of <= 3 groups), bounds often."""
  m = draw(st.integers(1, 4))
  s = draw(st.integers(1, 3))
  b = m * s
  c = draw(st.integers(1, min(3, b)))
  cuts = []
  if c > 1:
    cuts = sorted(
      draw(st.lists(st.integers(1, b - 1), min_size=c - 1, max_size=c - 1, unique=True))
    )
  quotas = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, b], strict=True)]
  lows, highs = {}, {}
  for name, q in zip(NAMES, quotas, strict=False):
    if draw(st.booleans()):
      lows[name] = draw(st.integers(0, q // m))
    if draw(st.booleans()):
      highs[name] = draw(st.integers(-(-q // m), s))
  return QuotaSpec(dict(zip(NAMES, quotas, strict=False)), m, lows, highs)


@st.composite
def workloads(draw, exact=False):
  """A spec and an arrival order: `steps` steps' worth of every class, shuffled, plus extras."""
  spec = draw(specs())
  steps = draw(st.integers(1, 3))
  classes = [c for c, q in spec.class_quotas.items() for _ in range(q * steps)]
  if not exact:
    classes += draw(st.lists(st.sampled_from(spec.classes), max_size=4))
  order = draw(st.permutations(classes))
  return spec, steps, [group(i, c) for i, c in enumerate(order)]


# ---- feasibility --------------------------------------------------------------------------------


@st.composite
def states(draw, consistent=False):
  """Step states of a small spec with consistent totals (feasible or not), sometimes perturbed.

  ``consistent``: only states whose totals add up (an open mini-batch of at most B/M groups,
  remaining quota summing to the free slots), never perturbed.
  """
  spec = draw(specs())
  s, n = spec.groups_per_minibatch, len(spec.classes)
  if consistent:
    opened = []
    for _ in range(n):
      opened.append(draw(st.integers(0, s - sum(opened))))
  else:
    opened = draw(st.lists(st.integers(0, s), min_size=n, max_size=n))
  empty = draw(st.integers(0, spec.minibatches - 1))
  need = max(0, s - sum(opened) + empty * s)  # what the remaining quota must sum to
  # Split `need` at n - 1 drawn cuts: lopsided splits (one class short, another over its bounds)
  # come as often as even ones.
  cuts = sorted(draw(st.lists(st.integers(0, need), min_size=n - 1, max_size=n - 1)))
  remaining = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, need], strict=True)]
  if not consistent and draw(st.booleans()):  # off-total or negative states are rejected too
    remaining[draw(st.integers(0, n - 1))] += draw(st.sampled_from([-1, 1]))
  return spec, tuple(opened), tuple(remaining), empty


@PROPS
@given(states())
def test_closed_form_matches_brute_force(state):
  spec, opened, remaining, empty = state
  k = key(spec)
  quotas, lows, highs, size = k
  expected = sum(remaining) == size - sum(opened) + empty * size and oracle(
    k, opened, remaining, empty
  )
  assert completion_feasible(lows, highs, size, opened, remaining, empty) == expected


@settings(max_examples=600, deadline=None)  # cheap examples; boundary states are rare
@given(states(consistent=True), st.data())
def test_tracker_can_place_matches_brute_force(state, data):
  """At the drawn state and after each incremental `place` (feasible or not) until the open
  mini-batch is full: `feasible` and every `can_place` agree with brute force."""
  spec, opened, remaining, empty = state
  k = key(spec)
  quotas, lows, highs, size = k
  # The tracker only sees states with consistent totals (which the strategy draws).
  assume(sum(opened) <= size and sum(remaining) == size - sum(opened) + empty * size)
  tracker = FeasibilityTracker(quotas, lows, highs, spec.minibatches)
  tracker.set_state(opened, remaining, empty)
  while True:
    assert tracker.feasible() == oracle(k, opened, remaining, empty)
    for c in range(len(quotas)):
      expected = sum(opened) < size and oracle(k, *plus(opened, remaining, c), empty)
      assert tracker.can_place(c) == expected, (opened, remaining, c)
    left = [c for c in range(len(quotas)) if remaining[c] > 0]
    if not tracker.free or not left:
      break
    c = data.draw(st.sampled_from(left))
    tracker.place(c)
    opened, remaining = plus(opened, remaining, c)


@st.composite
def spec_shapes(draw):
  """(classes c, mini-batches m, groups per mini-batch s, lows, highs) with c <= B = m * s, so
  that every class can get a quota of at least one group."""
  m, s = draw(st.integers(1, 4)), draw(st.integers(1, 3))
  c = draw(st.integers(1, min(3, m * s)))
  bounds = st.lists(st.integers(0, 3), min_size=c, max_size=c)
  return c, m, s, draw(bounds), draw(bounds)


@PROPS
@given(spec_shapes())
def test_spec_is_accepted_iff_brute_force_finds_a_step(shape):
  c, m, s, lows, highs = shape
  b = m * s
  quotas = [b // c + (i < b % c) for i in range(c)]
  assume(0 not in quotas)  # a class with quota 0 is another error (the strategy avoids it)
  lo = dict(zip(NAMES, lows, strict=False))
  hi = dict(zip(NAMES, highs, strict=False))
  k = (tuple(quotas), tuple(lows), tuple(min(h, s) for h in highs), s)
  # The oracle's open mini-batch is mini-batch 0 (empty), followed by m - 1 empty ones.
  feasible = all(x <= y for x, y in zip(lows, highs, strict=True)) and oracle(
    k, (0,) * c, tuple(quotas), m - 1
  )
  try:
    QuotaSpec(dict(zip(NAMES, quotas, strict=False)), m, lo, hi)
    accepted = True
  except ValueError:
    accepted = False
  assert accepted == feasible


def test_balanced_split_respects_bounds_and_sizes():
  counts = balanced_split([6, 2], 4)
  assert counts == [[2, 0], [2, 0], [1, 1], [1, 1]]
  for quotas, m in [([5, 7, 4], 4), ([1, 1, 1, 3], 3), ([9], 3)]:
    split = balanced_split(quotas, m)
    assert {sum(row) for row in split} == {sum(quotas) // m}
    for c, q in enumerate(quotas):
      assert sum(row[c] for row in split) == q
      assert {row[c] for row in split} <= {q // m, -(-q // m)}


# ---- reference policies (literal, slow) ---------------------------------------------------------


def reference(spec, policy, groups):
  """Literal statement of `minibatch` / `greedy`: rescan every waiting group after every change.

  Returns, per offer, the released mini-batches as (step, index, group ids), and the number of
  mini-batches that were stalled after some offer (docs/admission.md).
  """
  cs, k = spec.classes, key(spec)
  quotas, lows, highs, size = k
  step = index = stalls = 0
  waiting, opened, placed, out, stalled = [], [], collections.Counter(), [], False

  def fits(g):
    c = cs.index(g.cls)
    counts = tuple(sum(h.cls == x for h in opened) for x in cs)
    if policy == "greedy":
      return counts[c] < highs[c]
    rem = tuple(spec.class_quotas[x] - placed[x] for x in cs)
    return len(opened) < size and oracle(k, *plus(counts, rem, c), spec.minibatches - 1 - index)

  for g in groups:
    waiting.append(g)
    released = []
    placed_any = True
    while placed_any:
      placed_any = False
      for w in waiting:
        if fits(w):
          waiting.remove(w)
          opened.append(w)
          placed[w.cls] += 1
          placed_any = True
          if len(opened) == size:
            released.append((step, index, [h.group_id for h in opened]))
            opened, stalled = [], False
            index += 1
            if index == spec.minibatches:
              step, index, placed = step + 1, 0, collections.Counter()
          break
    covered = all(sum(w.cls == c for w in waiting) >= spec.class_quotas[c] - placed[c] for c in cs)
    if waiting and covered and not stalled:
      stalled, stalls = True, stalls + 1
    out.append(released)
  return out, stalls


def reference_train_batch(spec, groups):
  """Step s is released by the offer that brings every class to (s + 1) * quota arrivals."""
  seen = collections.defaultdict(list)
  step, out = 0, []
  for g in groups:
    seen[g.cls].append(g.group_id)
    released = []
    while all(len(seen[c]) >= (step + 1) * q for c, q in spec.class_quotas.items()):
      ids = {
        gid for c, q in spec.class_quotas.items() for gid in seen[c][step * q : (step + 1) * q]
      }
      released.append((step, ids))
      step += 1
    out.append(released)
  return out


def run(spec, policy, groups, **kw):
  """Offers every group, checking the index-wide invariants after each offer."""
  idx = AdmissionIndex(spec, policy, **kw)
  per_offer, released = [], []
  for g in groups:
    got = idx.offer(g)
    assert all(isinstance(mb, MiniBatch) for mb in got)
    per_offer.append(got)
    released += got
    # Releases come in (step, index) order, with no gap.
    assert [(mb.step, mb.index) for mb in released] == [
      divmod(n, spec.minibatches) for n in range(len(released))
    ]
  return idx, per_offer, released


def check_steps(spec, released):
  """Every mini-batch has B/M groups within its bounds; every complete step meets its quotas."""
  for mb in released:
    assert len(mb.groups) == spec.groups_per_minibatch
    counts = collections.Counter(g.cls for g in mb.groups)
    for c in spec.classes:
      assert spec.min_of(c) <= counts[c] <= spec.max_of(c)
  by_step = collections.defaultdict(collections.Counter)
  for mb in released:
    by_step[mb.step].update(g.cls for g in mb.groups)
  for step, counts in by_step.items():
    if step < released[-1].step or released[-1].index == spec.minibatches - 1:
      assert dict(counts) == {c: q for c, q in spec.class_quotas.items()}


def check_conservation(idx, groups, released, rejected=()):
  out = [g.group_id for mb in released for g in mb.groups]
  pend = [g.group_id for g in idx.pending()]
  assert len(out) == len(set(out))  # never released twice
  assert sorted(out + pend + [g.group_id for g in rejected]) == [g.group_id for g in groups]


# ---- admission properties -----------------------------------------------------------------------


@PROPS
@given(workloads())
def test_minibatch_places_as_early_as_feasibility_allows(workload):
  spec, steps, groups = workload
  idx = AdmissionIndex(spec, "minibatch")
  k, released = key(spec), []
  for g in groups:
    released += idx.offer(g)
    opened, remaining, empty = step_state(spec, idx, released)
    assert oracle(k, opened, remaining, empty)  # the state always admits a completion
    if len(idx.open_groups()) < spec.groups_per_minibatch:
      for w in idx.waiting():
        c = spec.classes.index(w.cls)
        assert not oracle(k, *plus(opened, remaining, c), empty), (w, opened, remaining)
  check_steps(spec, released)
  check_conservation(idx, groups, released)
  assert len(released) >= steps * spec.minibatches  # enough supply: every step came out
  assert idx.stats()["stalls"] == 0


@pytest.mark.parametrize("policy", ["minibatch", "greedy"])
@PROPS
@given(workloads())
def test_matches_literal_reference(policy, workload):
  spec, _, groups = workload
  idx, per_offer, _ = run(spec, policy, groups)
  want, stalls = reference(spec, policy, groups)
  got = [[(mb.step, mb.index, [g.group_id for g in mb.groups]) for mb in r] for r in per_offer]
  assert got == want
  assert idx.stats()["stalls"] == stalls


@PROPS
@given(workloads(exact=True), st.sampled_from(["minibatch", "train_batch"]))
def test_exact_supply_releases_every_step_and_nothing_stalls(workload, policy):
  spec, steps, groups = workload
  idx, _, released = run(spec, policy, groups)
  check_steps(spec, released)
  check_conservation(idx, groups, released)
  assert len(released) == steps * spec.minibatches
  assert idx.pending() == []
  stats = idx.stats()
  assert (stats["stalls"], stats["violations"], stats["released_steps"]) == (0, 0, steps)
  assert stats["admitted"] == stats["released_groups"] == len(groups)


@PROPS
@given(workloads())
def test_train_batch_releases_whole_balanced_steps(workload):
  spec, _, groups = workload
  idx, per_offer, released = run(spec, "train_batch", groups)
  want = reference_train_batch(spec, groups)
  for got, expected in zip(per_offer, want, strict=True):
    assert len(got) == spec.minibatches * len(expected)
    for s, ids in expected:
      mbs = [mb for mb in got if mb.step == s]
      assert {g.group_id for mb in mbs for g in mb.groups} == ids
  check_steps(spec, released)
  check_conservation(idx, groups, released)
  for c in spec.classes:  # balanced composition: per class, mini-batches differ by at most one
    for s in {mb.step for mb in released}:
      n = [sum(g.cls == c for g in mb.groups) for mb in released if mb.step == s]
      assert max(n) - min(n) <= 1


@PROPS
@given(workloads())
def test_greedy_counts_what_it_breaks(workload):
  spec, _, groups = workload
  idx, _, released = run(spec, "greedy", groups)
  check_conservation(idx, groups, released)
  by_step = collections.defaultdict(collections.Counter)
  bad_mbs = 0
  for mb in released:
    counts = collections.Counter(g.cls for g in mb.groups)
    by_step[mb.step].update(counts)
    bad_mbs += any(not spec.min_of(c) <= counts[c] <= spec.max_of(c) for c in spec.classes)
  full_steps = len(released) // spec.minibatches
  bad_steps = sum(by_step[s] != collections.Counter(spec.class_quotas) for s in range(full_steps))
  stats = idx.stats()
  assert (stats["quota_violations"], stats["bound_violations"]) == (bad_steps, bad_mbs)
  assert stats["violations"] == bad_steps + bad_mbs


def test_greedy_violates_quotas_on_some_inputs_where_minibatch_does_not():
  rng = random.Random(0)
  greedy_bad = 0
  for _ in range(100):
    spec = QuotaSpec({"a": 3, "b": 3}, 3, {"a": 0}, {"a": 2, "b": 2})
    classes = ["a"] * 6 + ["b"] * 6
    rng.shuffle(classes)
    groups = [group(i, c) for i, c in enumerate(classes)]
    for policy in ("minibatch", "greedy"):
      idx, _, released = run(spec, policy, groups)
      if policy == "minibatch":
        check_steps(spec, released)
        assert idx.stats()["violations"] == 0
      else:
        greedy_bad += idx.stats()["quota_violations"] > 0
  assert greedy_bad > 10


def test_greedy_example_violates_and_stalls():
  # Quotas a=2, b=2 in M=2 mini-batches of 2, at most one b per mini-batch. Arrivals a, a, b, b.
  spec = QuotaSpec({"a": 2, "b": 2}, 2, {}, {"b": 1})
  arrivals = [group(i, c) for i, c in enumerate(["a", "a", "b", "b", "a"])]
  greedy = AdmissionIndex(spec, "greedy")
  out = [[[g.group_id for g in mb.groups] for mb in greedy.offer(g)] for g in arrivals[:4]]
  # Greedy fills mini-batch 0 with both a's; mini-batch 1 must then take two b's but may hold one:
  # b3 waits although the waiting groups cover the step's remaining quota: a stall.
  assert out == [[], [[0, 1]], [], []]
  assert [g.group_id for g in greedy.waiting()] == [3]
  assert greedy.stats()["stalls"] == 1
  # Only an a beyond the quota unblocks it, and step 0 ends with a=3, b=1: a quota violation.
  assert [[g.group_id for g in mb.groups] for mb in greedy.offer(arrivals[4])] == [[2, 4]]
  stats = greedy.stats()
  assert (stats["stalls"], stats["quota_violations"], stats["bound_violations"]) == (1, 1, 0)
  # Minibatch admission sees that a1 in mini-batch 0 would leave two b's for mini-batch 1.
  mb = AdmissionIndex(spec, "minibatch")
  out = [[[g.group_id for g in m.groups] for m in mb.offer(g)] for g in arrivals[:4]]
  assert out == [[], [], [[0, 2]], [[1, 3]]]
  assert mb.stats()["violations"] == mb.stats()["stalls"] == 0


def test_worked_example_from_docs():
  spec = QuotaSpec({"math": 6, "count": 2}, 4, {"count": 0}, {"count": 1})
  order = ["math"] * 6 + ["count"] * 2
  when = {}
  for policy in ("minibatch", "train_batch"):
    idx = AdmissionIndex(spec, policy)
    when[policy] = [
      [(mb.index, [g.group_id for g in mb.groups]) for mb in idx.offer(group(i, c))]
      for i, c in enumerate(order)
    ]
  assert when["minibatch"] == [
    [],
    [(0, [0, 1])],
    [],
    [(1, [2, 3])],
    [],
    [],  # math 5 waits: mini-batch 2 needs room for a count
    [(2, [4, 6])],
    [(3, [5, 7])],
  ]
  assert when["train_batch"] == [[]] * 7 + [[(0, [0, 1]), (1, [2, 3]), (2, [4, 6]), (3, [5, 7])]]
  greedy = AdmissionIndex(spec, "greedy")
  out = [mb for i, c in enumerate(order) for mb in greedy.offer(group(i, c))]
  assert [[g.group_id for g in mb.groups] for mb in out] == [[0, 1], [2, 3], [4, 5]]
  assert [g.group_id for g in greedy.waiting()] == [7]  # max count 1 blocks c7: a stall
  assert greedy.stats()["stalls"] == 1
  out = greedy.offer(group(8, "math"))  # a math group beyond the quota unblocks it
  assert [g.group_id for g in out[0].groups] == [6, 8]
  assert greedy.stats()["quota_violations"] == 1


@PROPS
@given(workloads(), st.sampled_from(POLICIES), st.integers(0, 40))
def test_state_dict_round_trip_continues_identically(workload, policy, cut):
  spec, _, groups = workload
  cut = min(cut, len(groups))
  ref = AdmissionIndex(spec, policy)
  want = [ref.offer(g) for g in groups]
  first = AdmissionIndex(spec, policy)
  got = [first.offer(g) for g in groups[:cut]]
  state = json.loads(json.dumps(first.state_dict()))
  second = AdmissionIndex(spec, policy)
  second.load_state_dict(state)
  assert second.pending() == first.pending()
  got += [second.offer(g) for g in groups[cut:]]
  assert got == want
  assert second.stats() == ref.stats()


@PROPS
@given(workloads(), st.sampled_from(POLICIES), st.data())
def test_dynamic_sampling_rejects_zero_variance_groups(workload, policy, data):
  spec, _, groups = workload
  stds = data.draw(
    st.lists(st.sampled_from([0.0, 0.5]), min_size=len(groups), max_size=len(groups))
  )
  groups = [group(g.group_id, g.cls, std=s) for g, s in zip(groups, stds, strict=True)]
  rejected = []
  idx, _, released = run(spec, policy, groups, dynamic_sampling=True, on_reject=rejected.append)
  assert rejected == [g for g in groups if g.reward_std == 0]
  assert all(g.reward_std > 0 for mb in released for g in mb.groups)
  check_conservation(idx, groups, released, rejected)
  assert idx.stats()["rejected"] == len(rejected)
  if policy != "greedy" and released:
    check_steps(spec, released)


@pytest.mark.parametrize("policy", POLICIES)
def test_remaining_hand_computed(policy):
  # Quotas a=4, b=2 in M=2 mini-batches of 3; arrivals a0 a1 b2 a3 a4 a5.
  spec = QuotaSpec({"a": 4, "b": 2}, 2)
  idx = AdmissionIndex(spec, policy)
  for i, c in enumerate("aabaaa"):
    idx.offer(group(i, c))
  # minibatch: (a0 a1 b2) released, a3 a4 open, a5 waiting; train_batch: all six waiting.
  # Either way a: 5 and b: 1 are placed or waiting for the next h steps, which need a: 4h and
  # b: 2h, so remaining is a: 4h - 5, b: 2h - 1 (at least 0): h=1 (0, 1), h=2 (3, 3), h=3 (7, 5).
  # greedy: (a0 a1 b2) (a3 a4 a5) released, closing step 0 over quota; step 1 is empty and
  # needs a: 4h, b: 2h.
  want = {
    "minibatch": [{"a": 0, "b": 1}, {"a": 3, "b": 3}, {"a": 7, "b": 5}],
    "train_batch": [{"a": 0, "b": 1}, {"a": 3, "b": 3}, {"a": 7, "b": 5}],
    "greedy": [{"a": 4, "b": 2}, {"a": 8, "b": 4}, {"a": 12, "b": 6}],
  }[policy]
  assert [idx.remaining(h) for h in (1, 2, 3)] == want
  idx.offer(group(6, "b"))
  # b6 closes step 0 (minibatch, train_batch) and step 1 has a5: a 4h - 1, b 2h. Greedy puts b6
  # into step 1: a 4h, b 2h - 1.
  want = {"greedy": [{"a": 4, "b": 1}, {"a": 8, "b": 3}]}.get(
    policy, [{"a": 3, "b": 2}, {"a": 7, "b": 4}]
  )
  assert [idx.remaining(h) for h in (1, 2)] == want


def test_remaining_does_not_carry_groups_over_quota_into_the_next_step():
  # Greedy, quotas a=2, b=2 in M=2 mini-batches of 2; arrivals a0 a1 a2: (a0 a1) released and a2
  # open, so step 0 holds a: 3 (one over quota) and b: 0. Step 0 needs a: max(0, 2 - 3) = 0 and
  # b: 2; step 1 needs its whole quota (the extra a belongs to step 0): h=2: a 0 + 2, b 2 + 2.
  idx = AdmissionIndex(QuotaSpec({"a": 2, "b": 2}, 2), "greedy")
  for i in range(3):
    idx.offer(group(i, "a"))
  assert [g.group_id for g in idx.open_groups()] == [2]
  assert (idx.remaining(1), idx.remaining(2)) == ({"a": 0, "b": 2}, {"a": 2, "b": 4})


@PROPS
@given(
  workloads(),
  st.sampled_from(["minibatch", "train_batch"]),
  st.integers(0, 30),
  st.integers(1, 3),
  st.data(),
)
def test_remaining_is_exactly_the_supply_that_finishes_the_next_steps(
  workload, policy, cut, horizon, data
):
  """Offering ``remaining(h)`` more groups of each class finishes the next ``h`` steps; one group
  fewer of any class with a positive count does not. (Greedy may stall instead: not covered.)"""
  spec, _, groups = workload
  idx, _, _ = run(spec, policy, groups[:cut])
  need = idx.remaining(horizon)
  state = json.loads(json.dumps(idx.state_dict()))
  order = data.draw(st.permutations([c for c, n in need.items() for _ in range(n)]))

  def steps_finished(classes):
    resumed = AdmissionIndex(spec, policy)
    resumed.load_state_dict(state)
    for i, c in enumerate(classes):
      resumed.offer(group(1000 + i, c))
    return resumed.step - idx.step

  assert steps_finished(order) == horizon
  for c in {c for c, n in need.items() if n}:
    fewer = list(order)
    fewer.remove(c)
    assert steps_finished(fewer) < horizon, c
  if policy == "minibatch" and idx.pending() == []:
    # Nothing waits: the step still needs every slot not yet released or open.
    placed = spec.groups_per_minibatch * idx.minibatch_index + len(idx.open_groups())
    assert sum(idx.remaining(1).values()) == spec.groups_per_step - placed


def test_errors_name_the_problem():
  spec = QuotaSpec({"a": 4}, 2)
  with pytest.raises(ValueError, match="policy='fifo'"):
    AdmissionIndex(spec, "fifo")
  idx = AdmissionIndex(spec)
  with pytest.raises(ValueError, match="class 'z'"):
    idx.offer(group(0, "z"))
  idx.offer(group(1, "a"))
  with pytest.raises(
    ValueError, match=r"group 1 was already offered to this index \(still pending\)"
  ):
    idx.offer(group(1, "a"))
  other = AdmissionIndex(spec, "greedy")
  with pytest.raises(ValueError, match="policy='minibatch'"):
    other.load_state_dict(idx.state_dict())


def test_a_state_of_another_quota_table_is_refused_naming_both_tables():
  # Resuming on another shape carries the admission state over; another quota table cannot be.
  idx = AdmissionIndex(QuotaSpec({"a": 4}, 2))
  idx.offer(group(1, "a"))
  other = AdmissionIndex(QuotaSpec({"a": 6}, 2))
  with pytest.raises(ValueError) as e:
    other.load_state_dict(json.loads(json.dumps(idx.state_dict())))
  msg = str(e.value)
  assert "'class_quotas': {'a': 4}" in msg and "'class_quotas': {'a': 6}" in msg
  assert "\n" not in msg and msg.count(". ") == 0


# ---- hostile input: re-offers and damaged checkpoints -------------------------------------------


def snapshot(idx):
  return json.dumps(idx.state_dict(), sort_keys=True)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_group_id_is_accepted_once_pending_released_or_rejected(policy):
  spec = QuotaSpec({"a": 2, "b": 2}, 2, max_per_minibatch={"b": 1})
  rejected = []
  idx = AdmissionIndex(spec, policy, dynamic_sampling=True, on_reject=rejected.append)
  released = []
  for i, c in enumerate("aabb"):  # minibatch/greedy: releases (a0 a1); b3 waits behind b2
    released += idx.offer(group(i, c))
  released += idx.offer(group(9, "a", std=0.0))  # rejected by dynamic sampling
  assert [g.group_id for g in rejected] == [9]
  pending = {g.group_id for g in idx.pending()}
  done = {g.group_id for mb in released for g in mb.groups}
  assert pending | done == {0, 1, 2, 3}
  for gid in sorted(pending | done | {9}):
    where = "still pending" if gid in pending else "released or rejected"
    before = snapshot(idx)
    with pytest.raises(ValueError, match=rf"group {gid} was already offered .*\({where}\)"):
      idx.offer(group(gid, "b" if gid in (2, 3) else "a"))
    assert snapshot(idx) == before  # refused before anything was counted or placed
  # The ids seen survive a checkpoint: a resumed index refuses them too.
  again = AdmissionIndex(spec, policy, dynamic_sampling=True)
  again.load_state_dict(json.loads(json.dumps(idx.state_dict())))
  for gid in (0, 3, 9):
    with pytest.raises(ValueError, match=f"group {gid} was already offered"):
      again.offer(group(gid, "a"))
  again.offer(group(np.int64(4), "a"))  # a new id is fine, a NumPy int too
  assert json.loads(json.dumps(again.state_dict()))["seen"] == [[0, 5], [9, 10]]


@PROPS
@given(workloads(), st.sampled_from(POLICIES), st.data())
def test_re_offers_change_nothing(workload, policy, data):
  """Re-offering any earlier id, anywhere in the stream, is refused and leaves no trace."""
  spec, _, groups = workload
  ref = AdmissionIndex(spec, policy)
  want = [ref.offer(g) for g in groups]
  idx = AdmissionIndex(spec, policy)
  got = []
  for i, g in enumerate(groups):
    got.append(idx.offer(g))
    for j in data.draw(st.lists(st.integers(0, i), max_size=2)):
      with pytest.raises(ValueError, match=f"group {groups[j].group_id} was already offered"):
        idx.offer(groups[j])
  assert got == want
  assert idx.stats() == ref.stats()


# Spec of the damaged-state cases: S = 3, at least one `a` and at most one `b` per mini-batch.
STATE_SPEC = QuotaSpec({"a": 3, "b": 3, "c": 3}, 3, {"a": 1}, {"b": 1})


def base_state(policy="minibatch"):
  """A JSON state at mini-batch 1 holding b3 c5 open and b4 waiting (minibatch policy)."""
  idx = AdmissionIndex(STATE_SPEC, policy)
  for i, c in enumerate("abcbbc"):
    idx.offer(group(i, c))
  state = json.loads(json.dumps(idx.state_dict()))
  if policy == "minibatch":
    assert [g["group_id"] for g in state["open"]] == [3, 5]
    assert [[s, g["group_id"]] for s, g in state["waiting"]] == [[4, 4]]
    assert (state["index"], state["placed"], state["seen"]) == (
      1,
      {"a": 1, "b": 2, "c": 2},
      [[0, 6]],
    )
  return state


def g_(i, c):
  return group(i, c).to_dict()


def _with(**changes):
  return lambda s: {**s, **changes}


# name -> (change to the base state, message)
BAD_STATES = {
  "open_group_twice": (
    lambda s: {**s, "open": [s["open"][0], s["open"][0]]},
    "admission state: group 3 appears twice in the open groups.",
  ),
  "waiting_group_twice": (
    lambda s: {**s, "waiting": [[2, s["waiting"][0][1]], s["waiting"][0]]},
    "admission state: group 4 appears twice in the waiting groups.",
  ),
  "open_and_waiting": (
    lambda s: {**s, "waiting": [[4, s["open"][0]]]},
    "admission state: group 3 appears in both the open and the waiting groups.",
  ),
  "open_unknown_class": (
    lambda s: {**s, "open": [s["open"][0], g_(5, "z")]},
    "admission state: open group 5 has class 'z', which the quota spec does not name",
  ),
  "waiting_unknown_class": (
    lambda s: {**s, "waiting": [[4, g_(4, "z")]]},
    "admission state: waiting group 4 has class 'z'",
  ),
  "bad_group_record": (
    lambda s: {**s, "waiting": [[4, {**g_(4, "b"), "reward_std": -1.0}]]},
    r"admission state: an entry of the waiting groups is not a group record \(GroupMeta.reward_std",
  ),
  "over_quota": (
    _with(index=2, placed={"a": 4, "b": 1, "c": 2}, open=[g_(3, "a")], waiting=[]),
    "admission state: class 'a' has 4 groups placed in step 0, over its quota of 3.",
  ),
  "open_over_max": (
    _with(placed={"a": 1, "b": 3, "c": 1}, open=[g_(3, "b"), g_(4, "b")], waiting=[]),
    "admission state: the open mini-batch holds 2 groups of class 'b', over its max_per_minibatch",
  ),
  "released_over_max": (
    _with(placed={"a": 1, "b": 2, "c": 0}, open=[], waiting=[]),
    "admission state: class 'b' has 2 groups in the 1 released mini-batches of step 0, over 1 x",
  ),
  "released_under_min": (
    _with(placed={"a": 0, "b": 1, "c": 2}, open=[], waiting=[]),
    "admission state: class 'a' has 0 groups in the 1 released mini-batches of step 0, under 1 x",
  ),
  "cannot_complete": (  # two c's open: the last slot cannot take both the a and the b it needs
    _with(index=0, placed={"a": 0, "b": 0, "c": 2}, open=[g_(3, "c"), g_(5, "c")]),
    r"admission state: step 0 cannot be completed .*still missing \{'a': 3, 'b': 3, 'c': 1\}",
  ),
  "placed_off_total": (
    _with(placed={"a": 2, "b": 2, "c": 2}),
    "admission state: placed counts 6 groups in step 0, but 1 released mini-batches of 3 and 2",
  ),
  "open_full": (
    lambda s: {**s, "open": [*s["open"], g_(7, "a")], "seen": [[0, 8]]},
    "admission state: the open mini-batch holds 3 groups; accepted: fewer than 3",
  ),
  "placed_unknown_class": (
    _with(placed={"a": 1, "b": 2, "z": 2}),
    "admission state: placed=.*; accepted: each class of",
  ),
  "index_out_of_range": (_with(index=3), r"admission state: index=3; accepted: an int in \[0, 3\)"),
  "arrivals_out_of_order": (
    lambda s: {**s, "waiting": [[4, g_(4, "b")], [1, g_(6, "b")]], "seen": [[0, 7]]},
    "admission state: waiting group 6 has arrival number 1; accepted: numbers increasing",
  ),
  "pending_not_seen": (
    _with(seen=[[0, 4]]),
    "admission state: pending group 5 is missing from the seen group ids.",
  ),
  "seen_not_sorted": (
    _with(seen=[[4, 6], [0, 2]]),
    r"admission state: seen: group id range \[0, 2\] overlaps, touches or precedes \[4, 6\]",
  ),
  "counter_missing": (
    lambda s: {**s, "counters": {k: v for k, v in s["counters"].items() if k != "stalls"}},
    "admission state: counters=.*; accepted: each of",
  ),
  "key_missing": (
    lambda s: {k: v for k, v in s.items() if k != "seen"},
    r"admission state: keys \['seen'\] are missing",
  ),
  "old_version": (_with(version=1), "admission state version 1 is not 2"),
}


@pytest.mark.parametrize("case", sorted(BAD_STATES))
def test_damaged_state_is_refused_and_changes_nothing(case):
  change, message = BAD_STATES[case]
  bad = change(base_state())
  target = AdmissionIndex(STATE_SPEC)
  for i, c in enumerate("aab"):  # some other state, so a half-done load would show
    target.offer(group(100 + i, c))
  before = snapshot(target)
  with pytest.raises(ValueError, match=message):
    target.load_state_dict(bad)
  assert snapshot(target) == before
  target.load_state_dict(base_state())  # the undamaged state loads
  assert [g.group_id for g in target.pending()] == [3, 5, 4]


def test_damaged_state_checks_depend_on_the_policy():
  # train_batch places nothing before a whole step is there; greedy may pass quotas (counted).
  state = base_state("train_batch")
  bad = {**state, "placed": {"a": 1, "b": 0, "c": 0}, "index": 0, "open": [g_(0, "a")]}
  bad["waiting"] = [w for w in state["waiting"] if w[1]["group_id"] != 0]
  idx = AdmissionIndex(STATE_SPEC, "train_batch")
  with pytest.raises(ValueError, match="a train_batch index places no group before"):
    idx.load_state_dict(bad)
  greedy = AdmissionIndex(STATE_SPEC, "greedy")
  state = base_state("greedy")
  over = {**state, "index": 2, "placed": {"a": 4, "b": 1, "c": 2}, "open": [g_(3, "a")]}
  over["waiting"] = []
  greedy.load_state_dict(over)  # greedy can reach this; minibatch cannot
  assert greedy.stats()["pending"] == 1
  with pytest.raises(ValueError, match="over its quota of 3"):
    AdmissionIndex(STATE_SPEC).load_state_dict({**over, "policy": "minibatch"})
