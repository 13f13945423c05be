"""Held-out evaluation: the pass@k estimator, the evaluator's counting, and a run that evaluates."""

import json
import math
import os

import jax
import numpy as np
import pytest

from configs import arith_tiny
from knitjax.config import from_config_dict
from knitjax.rollout.sampler import Samples
from knitjax.runtime import evaluation
from knitjax.runtime.evaluation import Evaluator, pass_at_k, read_eval
from knitjax.tasks.prompts import Prompt


def test_pass_at_k_by_hand():
  assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
  assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))  # 0.7
  assert pass_at_k(8, 3, 4) == pytest.approx(1 - math.comb(5, 4) / math.comb(8, 4))
  assert pass_at_k(5, 0, 3) == 0.0
  assert pass_at_k(5, 3, 3) == 1.0  # fewer than k wrong: every k-subset holds a correct one
  assert pass_at_k(200, 1, 100) == pytest.approx(0.5)
  for bad in ((4, 5, 1), (4, 1, 5), (4, 1, 0)):
    with pytest.raises(ValueError, match="pass@k"):
      pass_at_k(*bad)


class _FakeWorker:
  """Answers prompt i's j-th sample with token ``table[i][j]`` (greedy: column 0)."""

  def __init__(self, table):
    self.table, self.calls = table, []

  def sample(self, params, prompts, *, rng, group_size):
    self.calls.append((len(prompts), group_size))
    rows = [self.table[p.prompt_id][j] for p in prompts for j in range(group_size)]
    tokens = np.asarray(rows, np.int32)[:, None]
    n = len(rows)
    return Samples(tokens=tokens, lengths=np.ones(n, np.int32), logprobs=np.zeros((n, 1)))


class _Tok:
  def decode(self, ids):
    return " ".join(map(str, np.asarray(ids).tolist()))


def _prompt(i):
  return Prompt(prompt_id=i, cls="c", text="q", tokens=np.array([1, 2]), answer="7")


def test_evaluator_counts_greedy_and_pass_at_k():
  # Token 7 is the right answer. Prompt 0: greedy right, 2 of 4 samples; prompt 1: greedy wrong,
  # 1 of 4; prompt 2: nothing right.
  table = {0: [7, 7, 0, 0], 1: [0, 0, 7, 0], 2: [0, 0, 0, 0]}
  reward = lambda p, ids, tok: float(ids.tolist() == [7])  # noqa: E731
  greedy, sampled = _FakeWorker(table), _FakeWorker(table)
  ev = Evaluator(
    greedy=greedy,
    sampled=sampled,
    prompts=[_prompt(i) for i in range(3)],
    reward_fn=reward,
    tokenizer=_Tok(),
    k=2,
    samples=4,
    batch_prompts=2,
    batch_shards=4,
  )
  metrics, answers = ev(None, jax.random.key(0))
  assert metrics["eval_greedy_accuracy"] == pytest.approx(1 / 3)
  want = (pass_at_k(4, 2, 2) + pass_at_k(4, 1, 2) + 0.0) / 3
  assert metrics["eval_pass_at_2"] == pytest.approx(want)
  assert metrics["eval_sample_accuracy"] == pytest.approx(3 / 12)
  assert [a["solved"] for a in answers[""]] == [True, False, False]
  assert answers[""][0]["greedy"] == "7"
  # Calls are padded to whole batch shards (4): 2 prompts x 1 -> 4 rows, 1 prompt x 1 -> 4 rows.
  assert greedy.calls == [(4, 1), (4, 1)]
  assert sampled.calls == [(2, 4), (1, 4)]


def test_evaluator_scores_each_heldout_set_under_its_name():
  # Set "": prompts 0 and 1 (1 of 2 right); set "phrasings": prompts 2, 3 and 4 (2 of 3 right).
  table = {0: [7], 1: [0], 2: [7], 3: [7], 4: [0]}
  reward = lambda p, ids, tok: float(ids.tolist() == [7])  # noqa: E731
  ev = Evaluator(
    greedy=_FakeWorker(table),
    sampled=None,
    prompts=[_prompt(0), _prompt(1)],
    extra_sets={"phrasings": [_prompt(i) for i in (2, 3, 4)]},
    reward_fn=reward,
    tokenizer=_Tok(),
    k=1,
    samples=0,
    batch_prompts=8,
    batch_shards=1,
  )
  metrics, answers = ev(None, jax.random.key(0))
  low, high = evaluation.wilson_interval(2, 3)
  assert metrics == {
    "eval_greedy_accuracy": 0.5,
    "eval_greedy_accuracy_low": evaluation.wilson_interval(1, 2)[0],
    "eval_greedy_accuracy_high": evaluation.wilson_interval(1, 2)[1],
    "eval_prompts": 2,
    "eval_phrasings_greedy_accuracy": pytest.approx(2 / 3),
    "eval_phrasings_greedy_accuracy_low": low,
    "eval_phrasings_greedy_accuracy_high": high,
    "eval_phrasings_prompts": 3,
  }
  assert [a["prompt_id"] for a in answers["phrasings"]] == [2, 3, 4]
  assert [a["solved"] for a in answers[""]] == [True, False]
  assert ev.summary(metrics) == (
    f"greedy_accuracy 0.500 [{metrics['eval_greedy_accuracy_low']:.3f}, "
    f"{metrics['eval_greedy_accuracy_high']:.3f}]  (2 prompts); "
    f"phrasings: greedy_accuracy 0.667 [{low:.3f}, {high:.3f}]  (3 prompts)"
  )
  with pytest.raises(ValueError, match=r"at least one held-out prompt in set 'none'"):
    Evaluator(**{**_ev_kwargs(), "extra_sets": {"none": []}})
  with pytest.raises(ValueError, match=r"held-out set name 'Bad name' is not accepted"):
    Evaluator(**{**_ev_kwargs(), "extra_sets": {"Bad name": [_prompt(0)]}})


def _ev_kwargs():
  return dict(
    greedy=None,
    sampled=None,
    prompts=[_prompt(0)],
    reward_fn=None,
    tokenizer=_Tok(),
    k=1,
    samples=0,
    batch_prompts=1,
    batch_shards=1,
  )


def _eval_config(**eval_fields):
  c = arith_tiny.get_config("quick")
  c.eval = {**dict(every_steps=1, prompts=8, samples=4, k=2), **eval_fields}
  return from_config_dict(c)


def test_a_run_evaluates_before_during_and_after_and_the_cli_agrees(tmp_path):
  from knitjax.eval import evaluate
  from knitjax.run import train

  config = _eval_config()
  workdir = str(tmp_path)
  last = train(config, workdir)
  rows = read_eval(workdir)
  assert [r["step"] for r in rows] == [0, 1, 2]
  for r in rows:
    assert r["eval_prompts"] == 8
    for key in ("eval_greedy_accuracy", "eval_pass_at_2", "eval_sample_accuracy"):
      assert 0.0 <= r[key] <= 1.0
      # 8 prompts: greedy accuracy is a multiple of 1/8; sample accuracy of 1/32.
    assert r["eval_greedy_accuracy"] * 8 == pytest.approx(round(r["eval_greedy_accuracy"] * 8))
    assert r["eval_pass_at_2"] >= r["eval_sample_accuracy"] - 1e-9  # pass@2 >= pass@1
  assert last["eval_greedy_accuracy"] == rows[-1]["eval_greedy_accuracy"]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    metric_rows = [json.loads(line) for line in f]
  assert [r["eval_pass_at_2"] for r in metric_rows] == [r["eval_pass_at_2"] for r in rows[1:]]
  assert os.path.exists(os.path.join(workdir, "eval.png"))
  with open(os.path.join(workdir, "eval_answers_2.json")) as f:
    answers = json.load(f)
  assert len(answers) == 8
  assert np.mean([a["solved"] for a in answers]) == rows[-1]["eval_greedy_accuracy"]
  # Evaluating the saved checkpoint alone gives exactly the in-run evaluation of that step.
  alone = evaluate(config, workdir)
  assert alone["step"] == 2 and alone["checkpoint"]
  for key in ("eval_greedy_accuracy", "eval_pass_at_2", "eval_sample_accuracy"):
    assert alone[key] == rows[-1][key]


def test_eval_config_is_checked():
  with pytest.raises(ValueError, match=r"config.eval.k=5 must be <= config.eval.samples=4"):
    _eval_config(k=5)
  with pytest.raises(ValueError, match="config.eval.reward"):
    _eval_config(reward="nope")


@pytest.mark.parametrize(
  "successes,n,low,high",
  [(5, 10, 0.2366, 0.7634), (0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0), (62, 200, 0.2500, 0.3772)],
)
def test_wilson_interval_matches_the_textbook_values(successes, n, low, high):
  lo, hi = evaluation.wilson_interval(successes, n)
  assert lo == pytest.approx(low, abs=1e-4) and hi == pytest.approx(high, abs=1e-4)
  assert lo <= successes / n <= hi


@pytest.mark.parametrize("successes,n", [(-1, 10), (11, 10), (0, 0)])
def test_wilson_interval_refuses_impossible_counts(successes, n):
  with pytest.raises(ValueError, match="Wilson interval"):
    evaluation.wilson_interval(successes, n)


def test_a_heldout_file_shorter_than_eval_prompts_is_one_warning_line(tmp_path, caplog):
  """eval.prompts=50 with a 3-line eval.path evaluates the 3, and says so in one line."""
  import json
  import logging

  from configs import arith_tiny
  from knitjax.config import from_config_dict
  from knitjax.runtime.builder import build_eval_prompts
  from knitjax.tasks.registry import make_prompt_source
  from knitjax.tasks.streams import ClassStreams

  lines = [json.dumps({"question": f"{n}+1?", "answer": f"#### {n + 1}"}) for n in range(3)]
  heldout = tmp_path / "heldout.jsonl"
  heldout.write_text("\n".join(lines) + "\n")
  c = arith_tiny.get_config("quick")
  c.task = dict(name="gsm8k", path=str(heldout), reward="numeric_match")
  c.admission.quotas = {"gsm8k": 32}
  c.model.vocab_size = 128
  c.eval = dict(prompts=50, path=str(heldout))
  config = from_config_dict(c)
  _, tokenizer = make_prompt_source("gsm8k", seed=0, path=str(heldout))
  streams = ClassStreams(sources={}, tokenizer=tokenizer, prompt_len=0)
  with caplog.at_level(logging.WARNING):
    prompts = build_eval_prompts(config, streams)
  assert len(prompts) == 3
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert warnings == [
    f"config.eval.prompts=50 asks for 50 held-out prompts of class 'gsm8k', but {heldout} holds "
    "3: evaluating those 3."
  ]


def _one_step_config(**eval_fields):
  """The tiny decoder on the generated one-step problems, read with the character tokenizer."""
  c = arith_tiny.get_config("quick")
  c.model.vocab_size = 128
  c.task = dict(name="gsm8k", path="generated:one_step:train", reward="numeric_match")
  c.rollout.update(group_size=2, max_new_tokens=4)
  c.admission.quotas = {"gsm8k": 4}
  c.loop.steps = 1
  c.eval = {**dict(every_steps=1, prompts=4, batch_prompts=4), **eval_fields}
  return c


def test_a_run_evaluates_two_heldout_sets_each_with_its_interval(tmp_path):
  """Held-out numbers (the task's split) and held-out phrasings (config.eval.extra_paths): each
  set's accuracy and interval in eval.jsonl and metrics.jsonl, its answers, both in eval.png."""
  from knitjax.eval import evaluate
  from knitjax.run import train
  from knitjax.tasks import word_problems

  c = _one_step_config(extra_paths=("generated:one_step:heldout_phrasings",))
  config = from_config_dict(c)
  workdir = str(tmp_path)
  train(config, workdir)
  rows = read_eval(workdir)
  assert [r["step"] for r in rows] == [0, 1]
  for r in rows:
    for prefix in ("eval_", "eval_heldout_phrasings_"):
      acc = r[f"{prefix}greedy_accuracy"]
      assert r[f"{prefix}prompts"] == 4 and acc * 4 == round(acc * 4)
      assert (r[f"{prefix}greedy_accuracy_low"], r[f"{prefix}greedy_accuracy_high"]) == (
        evaluation.wilson_interval(round(acc * 4), 4)
      )
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    (metric_row,) = [json.loads(line) for line in f]
  assert metric_row["eval_heldout_phrasings_prompts"] == 4
  with open(os.path.join(workdir, "eval_answers_1_heldout_phrasings.json")) as f:
    phrasings = json.load(f)
  with open(os.path.join(workdir, "eval_answers_1.json")) as f:
    numbers = json.load(f)
  # Each set's answers are its own split's, in order.
  want = word_problems.fixed_split("heldout_phrasings", "one_step")[:4]
  assert [a["answer"] for a in phrasings] == [r["answer"].rpartition("#### ")[2] for r in want]
  want = word_problems.fixed_split("heldout", "one_step")[:4]
  assert [a["answer"] for a in numbers] == [r["answer"].rpartition("#### ")[2] for r in want]
  assert os.path.getsize(os.path.join(workdir, "eval.png")) > 0
  alone = evaluate(config, workdir)
  for key in ("eval_greedy_accuracy", "eval_heldout_phrasings_greedy_accuracy"):
    assert alone[key] == rows[-1][key]
  with open(os.path.join(workdir, "eval_checkpoint.json")) as f:
    assert len(json.load(f)["answers_heldout_phrasings"]) == 4


@pytest.mark.parametrize(
  "change, error",
  [
    (
      dict(extra_paths=("generated:one_step:heldout_phrase",)),
      r"config.eval.extra_paths\[0\]: unknown generated data 'generated:one_step:heldout_phrase'; "
      r"choose one of: .*generated:one_step:heldout_phrasings\.",
    ),
    (
      dict(extra_paths=("generated:mixed:heldout_phrasings",)),
      r"config.eval.extra_paths\[0\]: unknown generated data 'generated:mixed:heldout_phrasings'",
    ),
    (
      dict(extra_paths=("generated:one_step:heldout", "generated:mixed:heldout")),
      r"config.eval.extra_paths\[1\]='generated:mixed:heldout' and config.eval.extra_paths\[0\] "
      r"would both be reported as eval_heldout_\*",
    ),
    (dict(extra_paths=("",)), r"config.eval.extra_paths\[0\]='' is not accepted"),
  ],
)
def test_unknown_or_clashing_extra_heldout_sets_are_refused(change, error):
  with pytest.raises(ValueError, match=error):
    from_config_dict(_one_step_config(**change))


def test_extra_heldout_sets_need_a_task_that_reads_data():
  with pytest.raises(
    ValueError,
    match=r"config.eval.extra_paths=\['x.jsonl'\] is not accepted with "
    r"config.task.name='arith', which reads no files",
  ):
    _eval_config(extra_paths=("x.jsonl",))


def test_an_extra_set_that_is_the_heldout_set_is_refused():
  from knitjax.runtime.builder import build_eval_sets
  from knitjax.tasks.registry import make_prompt_source
  from knitjax.tasks.streams import ClassStreams

  config = from_config_dict(_one_step_config(extra_paths=("generated:one_step:heldout",)))
  _, tokenizer = make_prompt_source("gsm8k", seed=0, path="generated:one_step:train")
  streams = ClassStreams(sources={}, tokenizer=tokenizer, prompt_len=0)
  with pytest.raises(ValueError, match=r"extra_paths names 'generated:one_step:heldout', the "):
    build_eval_sets(config, streams)
