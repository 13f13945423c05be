"""Fault suite part (c): every generated bad input is refused in one sentence naming it."""

import pytest

from lab.faults import bad_inputs
from lab.faults.bad_inputs import BadInput, classify, core, strategies

KINDS = sorted(bad_inputs.KINDS)
CASES = {kind: cases for kind, (cases, _) in bad_inputs.KINDS.items()}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  return bad_inputs.run(str(tmp_path_factory.mktemp("bad_inputs")), examples=300)


def _raise(e):
  def call():
    raise e

  return call


def test_classify_counts_each_outcome():
  named = ("config.optimizer.lr",)
  ok = ValueError("config.optimizer.lr=-1 is not accepted; it must be > 0.")
  assert classify(BadInput("", named, _raise(ok))) == (("rejected",), ok)
  assert classify(BadInput("", named, lambda: None)) == (("silent_accepts",), None)
  crash = KeyError("lr")
  assert classify(BadInput("", named, _raise(crash))) == (("tracebacks",), crash)
  two_lines = ValueError("config.optimizer.lr is bad.\nTraceback (most recent call last):")
  assert classify(BadInput("", named, _raise(two_lines)))[0] == ("rejected", "not_one_sentence")
  vague = ValueError("could not convert string to float: 'x'")
  assert classify(BadInput("", named, _raise(vague)))[0] == ("rejected", "not_named")
  on_purpose = BadInput("", named, lambda: None, may_accept="0 turns the clip off")
  assert classify(on_purpose) == (("accepted",), None)
  missing = FileNotFoundError("/data/x.jsonl does not exist")
  assert classify(BadInput("", ("x.jsonl",), _raise(missing)))[0] == ("tracebacks",)
  assert classify(BadInput("", ("x.jsonl",), _raise(missing), file_errors=True))[0] == ("rejected",)


def _spin():
  while True:
    pass


def _allocate_a_terabyte():
  return "x" * 10**12


def test_an_isolated_input_that_never_returns_is_a_hang():
  outcome, err = classify(BadInput("", ("x",), _spin, timeout_s=1.0))
  assert outcome == ("hangs",) and "1 s" in str(err)


def test_an_isolated_input_reports_what_it_raised_in_its_child():
  ok = ValueError("x.jinja refused the messages.")
  assert classify(BadInput("", ("x.jinja",), _raise(ok), timeout_s=30))[0] == ("rejected",)
  assert classify(BadInput("", ("x",), lambda: None, timeout_s=30))[0] == ("silent_accepts",)
  outcome, err = classify(BadInput("", ("x",), _allocate_a_terabyte, timeout_s=30))
  assert outcome == ("tracebacks",) and core.error_name(err) == "MemoryError"


def test_allocation_follows_the_issue_and_keeps_every_case():
  minimum = {k: len(c) for k, c in CASES.items()}
  counts = bad_inputs.allocate(10_000, minimum)
  # the config extremes are exhaustive: every (field, extreme) once, beside the 10,000 drawn
  assert counts["config_extremes"] == minimum["config_extremes"] > 300
  assert sum(counts.values()) - counts["config_extremes"] == 10_000
  assert counts["configs"] == 4000 and counts["checkpoints"] == 100
  assert bad_inputs.allocate(10, minimum) == minimum


def test_the_same_seed_draws_the_same_inputs():
  def draws(seed):
    out = []
    core.generate_case(20, seed, lambda draw: out.append(draw(strategies.TEXT)))
    return out

  assert draws(3) == draws(3)
  assert draws(3) != draws(4)


def test_every_kind_and_case_is_exercised(report):
  assert set(report["by_kind"]) == set(KINDS)
  assert report["examples"] == sum(c["examples"] for c in report["by_kind"].values()) >= 300
  for kind, cases in CASES.items():
    assert report["by_kind"][kind]["examples"] >= len(cases)
    for name, _ in cases:
      counts = report["by_case"][f"{kind}/{name}"]
      assert counts["examples"] >= 1, (kind, name)
      outcomes = sum(
        counts[k] for k in ("rejected", "tracebacks", "silent_accepts", "hangs", "accepted")
      )
      assert outcomes == counts["examples"], (kind, name, counts)


@pytest.mark.parametrize("kind", KINDS)
def test_every_bad_input_is_refused_in_one_sentence_naming_it(report, kind):
  counts = report["by_kind"][kind]
  failures = [f for f in report["failures"] if f["kind"] == kind]
  assert counts["tracebacks"] == 0, failures
  assert counts["silent_accepts"] == 0, failures
  assert counts["not_one_sentence"] == 0, failures
  assert counts["not_named"] == 0, failures
  assert counts["hangs"] == 0, failures
  assert counts["rejected"] + counts["accepted"] == counts["examples"]
