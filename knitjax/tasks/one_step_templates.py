"""One-step word problems: one operation (+, -, * or /) on numbers up to a hundred, in a sentence.

The same contract as `knitjax.tasks.word_problem_templates` (a template takes a `Draw` and returns
``(question, solution steps, integer answer)``), one step each. They are the ``one_step`` family
of the generated data (`knitjax.tasks.word_problems`): SmolLM2-135M-Instruct answers about a
fifth of them greedily, so GRPO has mixed groups from its first step (docs/smollm2.md measures
the candidates this family was chosen from).
"""

from knitjax.tasks.word_problem_draws import Draw
from knitjax.tasks.word_problem_templates import Template

_ITEMS = ("apples", "marbles", "cookies", "stickers", "books", "pencils", "shells", "cards")
_CONTAINERS = ("bags", "boxes", "baskets", "jars", "packs")


def _more(d: Draw):
  (p,) = d.people(1)
  item, had, got = d.pick(_ITEMS), d.int(10, 60), d.int(10, 40)
  q = f"{p.name} has {had} {item}. {p.He} gets {got} more. How many {item} does {p.he} have now?"
  return q, [f"{p.He} has {had} + {got} = {had + got} {item}."], had + got


def _left(d: Draw):
  a, b = d.people(2)
  item, had = d.pick(_ITEMS), d.int(20, 90)
  gave = d.int(5, had - 5)
  q = (
    f"{a.name} has {had} {item}. {a.He} gives {gave} of them to {b.name}. "
    f"How many {item} does {a.name} have left?"
  )
  return q, [f"{a.name} has {had} - {gave} = {had - gave} {item} left."], had - gave


def _together(d: Draw):
  a, b = d.people(2)
  item, x, y = d.pick(_ITEMS), d.int(10, 60), d.int(10, 60)
  q = f"{a.name} has {x} {item} and {b.name} has {y} {item}. How many {item} do they have together?"
  return q, [f"Together they have {x} + {y} = {x + y} {item}."], x + y


def _how_many_more(d: Draw):
  a, b = d.people(2)
  item, y = d.pick(_ITEMS), d.int(5, 50)
  x = y + d.int(3, 40)
  q = (
    f"{a.name} has {x} {item} and {b.name} has {y} {item}. "
    f"How many more {item} does {a.name} have than {b.name}?"
  )
  return q, [f"{a.name} has {x} - {y} = {x - y} more {item}."], x - y


def _groups(d: Draw):
  (p,) = d.people(1)
  item, box, k, n = d.pick(_ITEMS), d.pick(_CONTAINERS), d.int(2, 9), d.int(3, 12)
  q = f"{p.name} has {k} {box} with {n} {item} in each. How many {item} does {p.he} have in all?"
  return q, [f"{p.He} has {k} * {n} = {k * n} {item}."], k * n


def _share(d: Draw):
  (p,) = d.people(1)
  item, k, n = d.pick(_ITEMS), d.int(2, 9), d.int(2, 12)
  q = (
    f"{p.name} shares {k * n} {item} equally among {k} friends. "
    f"How many {item} does each friend get?"
  )
  return q, [f"Each friend gets {k * n} / {k} = {n} {item}."], n


def _spend(d: Draw):
  (p,) = d.people(1)
  item, k, price = d.pick(_ITEMS), d.int(2, 9), d.int(2, 15)
  q = f"{p.name} buys {k} {item} for ${price} each. How many dollars does {p.he} spend?"
  return q, [f"{p.He} spends {k} * {price} = {k * price} dollars."], k * price


def _pages(d: Draw):
  (p,) = d.people(1)
  per_day, days = d.int(5, 30), d.int(2, 9)
  q = f"{p.name} reads {per_day} pages a day for {days} days. How many pages does {p.he} read?"
  return q, [f"{p.He} reads {per_day} * {days} = {per_day * days} pages."], per_day * days


ONE_STEP: dict[str, Template] = {
  "more": _more,
  "left": _left,
  "together": _together,
  "how_many_more": _how_many_more,
  "groups": _groups,
  "share": _share,
  "spend": _spend,
  "pages": _pages,
}
