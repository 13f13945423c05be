"""Held-out evaluation: greedy accuracy and pass@k of the current policy.

Every ``config.eval.every_steps`` train steps (and before the first, and after the last) the
policy answers held-out prompts that training never sees: once greedily (accuracy) and ``samples``
times at the rollout temperature (pass@k by the unbiased estimator of Chen et al., 2021). A
prompt counts as solved when the eval reward (``config.eval.reward``, default the task's) is at
least 1. Greedy accuracy comes with its 95% Wilson score interval (``eval_greedy_accuracy_low`` /
``_high``): with 200 prompts a 10-point change is about what the intervals can separate. Results
go to ``eval.jsonl``, ``metrics.jsonl`` (keys ``eval_*``), TensorBoard and
``eval.png``; ``python -m knitjax.eval`` runs the same evaluation on a saved checkpoint.

More held-out sets (``config.eval.extra_paths``: e.g. problems in phrasings that training never
saw, beside the training phrasings with held-out numbers) are scored the same way, each under
its name: ``eval_<name>_greedy_accuracy`` and its interval, ``eval_<name>_prompts``, and so on;
the greedy answers of set ``<name>`` go to ``eval_answers_<step>_<name>.json``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from absl import logging

from knitjax import workdir as wd
from knitjax.rollout.worker import RolloutWorker
from knitjax.tasks.prompts import Prompt

EVAL_FILE = "eval.jsonl"


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from ``n`` samples of which ``c`` are correct: 1 - C(n-c, k) / C(n, k).

  Computed as a product (Chen et al., 2021, "Evaluating Large Language Models Trained on Code"),
  which stays exact where the binomials overflow.
  """
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}.")
  if n - c < k:
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def wilson_interval(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
  """The Wilson score interval of a binomial proportion ``successes / n`` (95% at the default z).

  Unlike the normal approximation (p +- z sqrt(p(1-p)/n)) it stays inside [0, 1] and does not
  collapse to a point at 0 or n successes (Wilson, 1927; Brown, Cai and DasGupta, 2001 recommend
  it for small n and extreme p).
  """
  if not 0 <= successes <= n or n < 1:
    raise ValueError(
      f"a Wilson interval needs 0 <= successes <= n and n >= 1, got {successes}/{n}."
    )
  p = successes / n
  denom = 1.0 + z * z / n
  centre = (p + z * z / (2 * n)) / denom
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
  # At 0 or n successes the bound is exactly 0 or 1; the arithmetic above may miss it by an ulp.
  low = 0.0 if successes == 0 else max(0.0, centre - half)
  high = 1.0 if successes == n else min(1.0, centre + half)
  return low, high


class Evaluator:
  """Scores the policy on fixed lists of held-out prompts: one set, and any number more."""

  def __init__(
    self,
    *,
    greedy: RolloutWorker,
    sampled: RolloutWorker | None,
    prompts: Sequence[Prompt],
    reward_fn: Callable,
    tokenizer,
    k: int,
    samples: int,
    batch_prompts: int,
    batch_shards: int,
    extra_sets: Mapping[str, Sequence[Prompt]] | None = None,
  ):
    """Args:
    greedy: a rollout worker whose sampler runs at temperature 0.
    sampled: one at the rollout temperature (None: no pass@k).
    prompts: the held-out prompts, evaluated in this order (metrics ``eval_*``).
    reward_fn: the eval reward; >= 1 means solved.
    tokenizer: decodes completions for the reward.
    k: pass@k's k (<= samples).
    samples: samples per prompt for pass@k.
    batch_prompts: prompts per sampler call.
    batch_shards: the rollout mesh's batch shards (calls are padded to a multiple).
    extra_sets: more held-out sets by name (lowercase letters, digits and _), each scored as
      ``prompts`` is, its metrics ``eval_<name>_*``.
    """
    self.sets = {"": list(prompts), **{k: list(v) for k, v in (extra_sets or {}).items()}}
    for name, members in self.sets.items():
      if name and not re.fullmatch(r"[a-z0-9_]+", name):
        raise ValueError(f"held-out set name {name!r} is not accepted; use a-z, 0-9 and _.")
      if not members:
        raise ValueError(
          f"evaluation needs at least one held-out prompt{f' in set {name!r}' if name else ''}."
        )
    if sampled is not None and not 1 <= k <= samples:
      raise ValueError(f"config.eval.k={k} must be in [1, config.eval.samples={samples}].")
    self._greedy, self._sampled = greedy, sampled
    self._reward_fn, self._tokenizer = reward_fn, tokenizer
    self.k, self.samples = k, samples
    self._batch = max(1, batch_prompts)
    self._shards = batch_shards

  @property
  def prompts(self) -> list[Prompt]:
    """The first held-out set."""
    return self.sets[""]

  def _solved(
    self, worker: RolloutWorker, prompts: list[Prompt], params, g: int, rng: jax.Array
  ) -> tuple[np.ndarray, list[str]]:
    """[P, g] bools (sample j of prompt i solved) and the first sample's text per prompt."""
    solved, texts = [], []
    for start in range(0, len(prompts), self._batch):
      chunk = prompts[start : start + self._batch]
      # Pad the call to whole batch shards by repeating the last prompt; extras are dropped.
      rows_needed = -(-len(chunk) * g // self._shards) * self._shards
      padded = chunk + [chunk[-1]] * (-(-rows_needed // g) - len(chunk))
      s = worker.sample(params, padded, rng=jax.random.fold_in(rng, start), group_size=g)
      for i, prompt in enumerate(chunk):
        row = []
        for j in range(g):
          r = i * g + j
          ids = s.tokens[r, : s.lengths[r]]
          row.append(float(self._reward_fn(prompt, ids, self._tokenizer)) >= 1.0)
          if j == 0:
            texts.append(self._tokenizer.decode(ids))
        solved.append(row)
    return np.asarray(solved, bool), texts

  def __call__(self, params, rng: jax.Array) -> tuple[dict[str, float], dict[str, list[dict]]]:
    """Returns (metrics, the greedy answers by set name: one record per prompt).

    The first set's metrics are ``eval_greedy_accuracy`` and so on (its answers under ``""``),
    set ``name``'s ``eval_<name>_greedy_accuracy`` and so on.
    """
    metrics, answers = {}, {}
    for i, (name, prompts) in enumerate(self.sets.items()):
      set_rng = rng if i == 0 else jax.random.fold_in(rng, 1000 + i)
      set_metrics, answers[name] = self._score(prompts, params, set_rng)
      prefix = f"eval_{name}_" if name else "eval_"
      metrics.update({prefix + k: v for k, v in set_metrics.items()})
    return metrics, answers

  def _score(
    self, prompts: list[Prompt], params, rng: jax.Array
  ) -> tuple[dict[str, float], list[dict]]:
    greedy, texts = self._solved(self._greedy, prompts, params, 1, jax.random.fold_in(rng, 0))
    low, high = wilson_interval(int(greedy.sum()), greedy.size)
    metrics = {
      "greedy_accuracy": float(greedy.mean()),
      "greedy_accuracy_low": low,
      "greedy_accuracy_high": high,
      "prompts": len(prompts),
    }
    if self._sampled is not None:
      rng_s = jax.random.fold_in(rng, 1)
      hits, _ = self._solved(self._sampled, prompts, params, self.samples, rng_s)
      n = self.samples
      metrics[f"pass_at_{self.k}"] = float(
        np.mean([pass_at_k(n, int(c), self.k) for c in hits.sum(axis=1)])
      )
      metrics["sample_accuracy"] = float(hits.mean())
    answers = [
      {"prompt_id": p.prompt_id, "answer": p.answer, "greedy": t, "solved": bool(ok)}
      for p, t, ok in zip(prompts, texts, greedy[:, 0], strict=True)
    ]
    return metrics, answers

  def summary(self, metrics: dict[str, float]) -> str:
    """``greedy_accuracy 0.310 [0.249, 0.378]  pass_at_4 ...  (200 prompts)`` per set, for the
    log; sets after the first are named."""
    parts = []
    for name in self.sets:
      prefix = f"eval_{name}_" if name else "eval_"
      text = _summary({k[len(prefix) :]: v for k, v in metrics.items() if k.startswith(prefix)})
      parts.append(f"{name}: {text}" if name else text)
    return "; ".join(parts)


class EvalLog:
  """``workdir/eval.jsonl`` (one row per evaluation) and the greedy answers of the last one."""

  def __init__(self, workdir: str, *, start_step: int, primary: bool = True):
    self.primary = primary
    self.path = wd.path(workdir, EVAL_FILE)
    self._workdir = workdir
    self._rows = None
    if primary:  # a resumed run redoes evaluations after it
      kept = [r for r in read_eval(workdir) if r["step"] <= start_step]
      self._rows = wd.JsonlFile(self.path, kept)
      self._rows.flush()

  def done(self, step: int) -> bool:
    """Whether step ``step`` was already evaluated (kept across a resume)."""
    return any(r["step"] == step for r in read_eval(self._workdir))

  def write(self, step: int, metrics: dict[str, float], answers: dict[str, list[dict]]) -> None:
    """Appends the row of ``step`` and writes each set's greedy answers (`answers_file`)."""
    if not self.primary:
      return
    self._rows.write({"step": step, **metrics})
    self._rows.flush()
    for name, records in answers.items():
      file = wd.path(self._workdir, answers_file(step, name))
      file.write_text(json.dumps(records, indent=1))


def answers_file(step: int, name: str = "") -> str:
  """``eval_answers_<step>.json``: the greedy answers of the first held-out set at ``step``;
  ``eval_answers_<step>_<name>.json``: those of set ``name``."""
  return f"eval_answers_{step}_{name}.json" if name else f"eval_answers_{step}.json"


def read_eval(workdir: str) -> list[dict]:
  """The rows of ``workdir/eval.jsonl``; a torn last line (a crash mid-write) is dropped."""
  return wd.read_rows(wd.path(workdir, EVAL_FILE))


# A metric key of the eval rows that the plot draws: eval_[<set name>_]greedy_accuracy or
# eval_[<set name>_]pass_at_<k>.
_PLOTTED = re.compile(r"eval_(?:(\w+)_)??(greedy_accuracy|pass_at_\d+)")


def plot_eval(workdir: str) -> str | None:
  """Writes ``workdir/eval.png``: held-out greedy accuracy (with its 95% interval where the rows
  have one) and pass@k against the train step, one curve per held-out set."""
  rows = read_eval(workdir)
  if not rows:
    return None
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 3.5))
  steps = [r["step"] for r in rows]
  # Pass@k curves first, then greedy accuracy; the first set before the others.
  curves = {m[0]: (m[1] or "", m[2]) for r in rows for k in r if (m := _PLOTTED.fullmatch(k))}
  names = sorted({name for name, _ in curves.values()})
  # Each set's points a little to the right of the one before, so error bars do not overlap.
  shift = 0.015 * max(max(steps) - min(steps), 1)
  for key, (name, metric) in sorted(
    curves.items(), key=lambda kv: (kv[1][1] == "greedy_accuracy", *kv[1])
  ):
    label = f"{name}: {metric}" if name else metric
    x = [step + shift * names.index(name) for step in steps]
    values = [r.get(key, math.nan) for r in rows]
    bounds = [(r.get(f"{key}_low"), r.get(f"{key}_high")) for r in rows]
    if all(lo is not None and hi is not None for lo, hi in bounds):
      err = np.array([[v - lo, hi - v] for v, (lo, hi) in zip(values, bounds, strict=True)]).T
      ax.errorbar(x, values, yerr=err, marker="o", capsize=3, label=f"{label} (95% CI)")
    else:
      ax.plot(x, values, marker="o", label=label)
  ax.set_xlabel("train step")
  ax.set_ylabel("held-out accuracy")
  ax.set_ylim(-0.02, 1.02)
  ax.grid(alpha=0.3)
  ax.legend(loc="upper right")
  fig.tight_layout()
  path = wd.path(workdir, "eval.png")
  with path.open("wb") as f:
    fig.savefig(f, format="png", dpi=120)
  plt.close(fig)
  return str(path)


def _summary(metrics: dict[str, float]) -> str:
  """``greedy_accuracy 0.310 [0.249, 0.378]  pass_at_4 ...  (200 prompts)`` for one set's
  metrics, keys without their ``eval_`` prefix."""
  parts = []
  for k in (
    "greedy_accuracy",
    *(k for k in metrics if k.startswith("pass_at_")),
    "sample_accuracy",
  ):
    if k not in metrics:
      continue
    text = f"{k} {metrics[k]:.3f}"
    if f"{k}_low" in metrics:
      text += f" [{metrics[f'{k}_low']:.3f}, {metrics[f'{k}_high']:.3f}]"
    parts.append(text)
  return "  ".join(parts) + f"  ({metrics.get('prompts', 0)} prompts)"


class PeriodicEval:
  """Evaluates before training, every ``every_steps`` steps and after the last step."""

  def __init__(self, evaluator: Evaluator, log: EvalLog, *, every_steps: int, total_steps: int):
    self.evaluator, self.log = evaluator, log
    self.every, self.total = every_steps, total_steps

  def due(self, step: int) -> bool:
    return step == 0 or step % self.every == 0 or step == self.total

  def maybe_run(self, step: int, params, rng: jax.Array) -> dict[str, float]:
    """The eval metrics of ``step`` (steps completed) if one is due and not yet logged, else {}."""
    if not self.due(step) or self.log.done(step):
      return {}
    metrics, answers = self.evaluator(params, jax.random.fold_in(rng, step))
    self.log.write(step, metrics, answers)
    logging.info("eval at step %d: %s", step, self.evaluator.summary(metrics))
    return metrics
