"""How much room and signal a candidate task gives SmolLM2-135M-Instruct before any training.

For each candidate it measures the base model's greedy accuracy on ``--greedy`` problems and, at
``--temperature``, the accuracy of ``--groups`` groups of ``--group_size`` samples and the fraction
of groups with mixed rewards (some right, some wrong: GRPO's only signal), with the mean response
length (how often ``--max_new_tokens`` cuts answers off). A problem counts as solved when its
answer (the number after '####', else the last number) equals the exact answer.

  python -m lab.scripts.smollm2_task_probe --tasks add2:plain,ostep:plain --max_new_tokens 64 \
      --temperature 0.7

A task is ``<family>:<prompt>``. Families: ``add2`` / ``sub2`` (two 2-digit numbers), ``mul12``
(1-digit x 2-digit), ``word1`` (one sentence-long addition), ``ostep`` (the held-out one-step
word problems, ``generated:one_step:heldout``), ``mixed`` (the held-out 1-3 step word problems).
Prompts: ``plain`` (the question alone as a chat message), ``short`` (a system message asking for
the number only), ``instr`` (the gsm8k task's step-by-step instruction after the question). The
figures of docs/smollm2.md ("Choosing the task") come from this script.
"""

import argparse
import json
import time
from fractions import Fraction

import jax
import numpy as np

from knitjax import sharding
from knitjax.chat import sample_chat
from knitjax.models import gguf_cache, hf
from knitjax.models.hf_tokenizer import HFTokenizer
from knitjax.tasks import gsm8k, word_problems
from knitjax.tasks.math_verifier import answer_number


def _split(family):
  records = word_problems.fixed_split("heldout", family)

  def draw(r):
    rec = records[int(r.integers(len(records)))]
    return rec["question"], int(rec["answer"].split("####")[-1])

  return draw


def _add2(r):
  a, b = r.integers(10, 100, 2)
  return f"What is {a} + {b}?", a + b


def _sub2(r):
  b, a = sorted(r.integers(10, 100, 2))
  return f"What is {a} - {b}?", a - b


def _mul12(r):
  a, b = r.integers(2, 10), r.integers(10, 100)
  return f"What is {a} * {b}?", a * b


def _word1(r):
  a, b = r.integers(3, 40), r.integers(2, 30)
  return f"Sam has {a} apples. He buys {b} more apples. How many apples does Sam have now?", a + b


FAMILIES = {
  "add2": _add2,
  "sub2": _sub2,
  "mul12": _mul12,
  "word1": _word1,
  "ostep": _split("one_step"),
  "mixed": _split("mixed"),
}
PROMPTS = ("plain", "short", "instr")


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tasks", default="ostep:plain")
  ap.add_argument("--max_new_tokens", type=int, default=64)
  ap.add_argument("--temperature", type=float, default=0.7)
  ap.add_argument("--greedy", type=int, default=200, help="problems answered greedily")
  ap.add_argument("--groups", type=int, default=32, help="problems sampled as groups")
  ap.add_argument("--group_size", type=int, default=8)
  args = ap.parse_args()
  folder = gguf_cache.smollm2_folder()
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  _, graphdef, params = hf.init_from_hf(folder, mesh)
  tok = HFTokenizer.from_folder(folder)

  def encode(question, prompt):
    system = [{"role": "system", "content": "Answer with only the final number."}]
    text = f"{question}\n\n{gsm8k.INSTRUCTION}" if prompt == "instr" else question
    messages = (system if prompt == "short" else []) + [{"role": "user", "content": text}]
    return tok.apply_chat_template(messages, tokenize=True)

  def answers(prompts, temperature, seed):
    ids = sample_chat(
      folder,
      prompts,
      max_new_tokens=args.max_new_tokens,
      temperature=temperature,
      seed=seed,
      model=(mesh, graphdef, params),
    )
    return [tok.decode(row) for row in ids], np.array([len(row) for row in ids])

  for task in args.tasks.split(","):
    family, _, prompt = task.partition(":")
    if family not in FAMILIES or prompt not in PROMPTS:
      raise SystemExit(f"unknown task {task!r}: <{'|'.join(FAMILIES)}>:<{'|'.join(PROMPTS)}>")
    r = np.random.default_rng(1)
    items = [FAMILIES[family](r) for _ in range(max(args.greedy, args.groups))]
    t0 = time.time()
    texts, lengths = answers([encode(q, prompt) for q, _ in items[: args.greedy]], 0.0, 0)
    greedy = [answer_number(t) == Fraction(int(a)) for t, (_, a) in zip(texts, items, strict=False)]
    g = args.group_size
    grouped = [encode(q, prompt) for q, _ in items[: args.groups] for _ in range(g)]
    stexts, slengths = answers(grouped, args.temperature, 1)
    ok = np.array(
      [answer_number(t) == Fraction(int(items[i // g][1])) for i, t in enumerate(stexts)]
    ).reshape(args.groups, g)
    row = {
      "task": task,
      "max_new_tokens": args.max_new_tokens,
      "temperature": args.temperature,
      "greedy_accuracy": float(np.mean(greedy)),
      "greedy_problems": len(greedy),
      "sample_accuracy": float(ok.mean()),
      "mixed_groups": float(np.mean((ok.sum(1) > 0) & (ok.sum(1) < g))),
      "groups": args.groups,
      "mean_length_greedy": float(lengths.mean()),
      "mean_length_sampled": float(slengths.mean()),
      "seconds": round(time.time() - t0, 1),
      "example": texts[0],
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
