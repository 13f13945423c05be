"""One-step word problems: one operation (+, -, * or /) on numbers up to a hundred, in a sentence.

The same contract as `knitjax.tasks.word_problem_templates` (a template takes a `Draw` and returns
``(question, solution steps, integer answer)``), one step each. They are the ``one_step`` family
of the generated data (`knitjax.tasks.word_problems`): SmolLM2-135M-Instruct answered about a
fifth of the family's first 8 phrasings greedily, so GRPO has mixed groups from its first step
(docs/smollm2.md measures the candidates this family was chosen from).

The phrasings come in two disjoint sets, so that a test can tell learning the arithmetic from
learning the sentences: `ONE_STEP` (36 phrasings, 9 per operation) is what training sees and
what the held-out-numbers split reuses with other names and numbers; `ONE_STEP_HELDOUT`
(14 phrasings) is never trained on and makes the held-out-phrasings split. Each held-out phrasing
is its own sentence shape and scenario, not a train phrasing with a word swapped
(tests/tasks/test_word_problems.py checks that they share no sentence and no run of four words).

A phrasing is data (`OneStep`): its text with slots, its operation, and the ranges its two
numbers are drawn from, so every answer is exact by construction (a difference is never
negative, a quotient always whole).
"""

import dataclasses
from collections.abc import Mapping

from knitjax.tasks.word_problem_draws import Draw

_ITEMS = ("apples", "marbles", "cookies", "stickers", "books", "pencils", "shells", "cards")
_CONTAINERS = ("bags", "boxes", "baskets", "jars", "packs")


@dataclasses.dataclass(frozen=True)
class OneStep:
  """A one-step phrasing: text with slots, its operation, and how its two numbers are drawn.

  ``text`` holds ``{a}`` and ``{b}`` (the numbers the question gives; the answer is ``a op b``)
  and may hold ``{name}`` and ``{name2}`` (two different people), the first person's pronouns
  ``{he} {He} {him} {his} {His}``, and a slot per key of ``words`` (one of its options).
  ``first`` and ``second`` are inclusive ranges: of ``a`` and ``b`` for + and *; of ``b`` and
  the answer for - and / (then ``a = b + answer`` or ``a = b * answer``).
  """

  text: str
  op: str
  first: tuple[int, int]
  second: tuple[int, int]
  words: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  unit: str = ""  # after the result in the worked step; may hold the slots too

  def __post_init__(self):
    if self.op not in ("+", "-", "*", "/"):
      raise ValueError(f"OneStep op {self.op!r} is not one of: +, -, *, /.")

  def __call__(self, d: Draw) -> tuple[str, list[str], int]:
    p, q = d.people(2)
    slots = {"name": p.name, "name2": q.name, "he": p.he, "He": p.He, "him": p.him}
    slots |= {"his": p.his, "His": p.His}
    slots |= {key: d.pick(options) for key, options in sorted(self.words.items())}
    x, y = d.int(*self.first), d.int(*self.second)
    if self.op in ("+", "*"):
      a, b = x, y
      answer = a + b if self.op == "+" else a * b
    else:  # "-" and "/" draw the answer and build a from it
      b, answer = x, y
      a = b + answer if self.op == "-" else b * answer
    slots |= {"a": a, "b": b}
    unit = f" {self.unit.format(**slots)}" if self.unit else ""
    return self.text.format(**slots), [f"{a} {self.op} {b} = {answer}{unit}."], answer


_BAKED = {"item": ("muffins", "rolls", "pies", "bagels", "scones")}
_PRODUCE = {"item": ("oranges", "potatoes", "lemons", "onions", "pears")}
_BOWL = {"item": ("beads", "balloons", "marbles", "buttons")}
_CROP = {"item": ("tomato", "pepper", "bean", "corn", "pumpkin")}

# What training sees (and the held-out-numbers split, with other names and numbers).
# fmt: off
ONE_STEP: dict[str, OneStep] = {
  # +
  "more": OneStep(
    "{name} has {a} {item}. {He} gets {b} more. How many {item} does {he} have now?",
    "+", (10, 60), (10, 40), {"item": _ITEMS}, "{item}"),
  "together": OneStep(
    "{name} has {a} {item} and {name2} has {b} {item}. How many {item} do they have together?",
    "+", (10, 60), (10, 60), {"item": _ITEMS}, "{item}"),
  "bus": OneStep(
    "A bus has {a} passengers. At the next stop, {b} more people get on. How many passengers "
    "are on the bus now?", "+", (10, 50), (5, 30), unit="passengers"),
  "laps": OneStep(
    "On Monday {name} ran {a} laps and on Tuesday {he} ran {b} laps. How many laps did {he} run "
    "over the two days?", "+", (5, 40), (5, 40), unit="laps"),
  "bowl": OneStep(
    "There are {a} red {item} and {b} blue {item} in a bowl. How many {item} are in the bowl "
    "altogether?", "+", (10, 60), (10, 60), _BOWL, "{item}"),
  "gift": OneStep(
    "How many dollars does {name} have after {his} aunt gives {him} ${b}, if {he} started with "
    "${a}?", "+", (10, 80), (5, 50), unit="dollars"),
  "trail": OneStep(
    "The first part of a trail is {a} meters long and the second part is {b} meters long. What "
    "is the length of the whole trail in meters?", "+", (50, 90), (20, 90), unit="meters"),
  "crates": OneStep(
    "Find the total number of {item} if one crate holds {a} {item} and another holds {b}.",
    "+", (10, 60), (10, 60), _PRODUCE, "{item}"),
  "score": OneStep(
    "{name} scored {a} points in the first game and {b} points in the second. What was {his} "
    "total score?", "+", (5, 40), (5, 40), unit="points"),
  # -
  "left": OneStep(
    "{name} has {a} {item}. {He} gives {b} of them to {name2}. How many {item} does {name} have "
    "left?", "-", (5, 40), (5, 50), {"item": _ITEMS}, "{item}"),
  "how_many_more": OneStep(
    "{name} has {a} {item} and {name2} has {b} {item}. How many more {item} does {name} have "
    "than {name2}?", "-", (5, 50), (3, 40), {"item": _ITEMS}, "{item}"),
  "unsold": OneStep(
    "A baker made {a} {item}. By noon, {b} had been sold. How many {item} are still unsold?",
    "-", (5, 40), (5, 40), _BAKED, "{item}"),
  "points_needed": OneStep(
    "{name} needs {a} points to win the game. {He} already has {b} points. How many more points "
    "does {he} need?", "-", (10, 60), (5, 40), unit="points"),
  "temperature": OneStep(
    "The temperature at noon was {a} degrees. By night it had dropped by {b} degrees. What was "
    "the temperature at night?", "-", (3, 20), (20, 60), unit="degrees"),
  "parking": OneStep(
    "A parking lot has {a} spaces and {b} of them are taken. How many spaces are free?",
    "-", (10, 60), (5, 40), unit="spaces"),
  "pages_left": OneStep(
    "{name} is reading a book with {a} pages and has read {b} of them. How many pages are left "
    "to read?", "-", (10, 80), (10, 80), unit="pages"),
  "height": OneStep(
    "What is the difference in height between a tree that is {a} cm tall and a bush that is {b} "
    "cm tall?", "-", (20, 90), (10, 60), unit="cm"),
  "jar": OneStep(
    "Of the {a} {item} in a jar, {name} takes out {b}. How many {item} remain in the jar?",
    "-", (5, 40), (5, 40), {"item": ("candies", "buttons", "coins", "beads")}, "{item}"),
  # *
  "groups": OneStep(
    "{name} has {a} {box} with {b} {item} in each. How many {item} does {he} have in all?",
    "*", (2, 9), (3, 12), {"item": _ITEMS, "box": _CONTAINERS}, "{item}"),
  "spend": OneStep(
    "{name} buys {a} {item} for ${b} each. How many dollars does {he} spend?",
    "*", (2, 9), (2, 15), {"item": _ITEMS}, "dollars"),
  "pages": OneStep(
    "{name} reads {a} pages a day for {b} days. How many pages does {he} read?",
    "*", (5, 30), (2, 9), unit="pages"),
  "desks": OneStep(
    "A classroom has {a} rows of desks with {b} desks in every row. How many desks are there?",
    "*", (3, 9), (4, 10), unit="desks"),
  "tickets": OneStep(
    "Each ticket to the fair costs ${a}. What do {b} tickets cost, in dollars?",
    "*", (3, 15), (2, 9), unit="dollars"),
  "printer": OneStep(
    "If a printer prints {a} pages per minute, how many pages does it print in {b} minutes?",
    "*", (10, 40), (2, 9), unit="pages"),
  "league": OneStep(
    "There are {a} teams in a league and each team has {b} players. Work out how many players "
    "are in the league.", "*", (4, 12), (3, 11), unit="players"),
  "rows_planted": OneStep(
    "A farmer plants {a} rows of {item} plants with {b} plants in each row. How many {item} "
    "plants are there?", "*", (3, 9), (4, 12), _CROP, "plants"),
  "gum": OneStep(
    "A pack of gum has {b} sticks. How many sticks are in {a} packs?",
    "*", (2, 9), (5, 12), unit="sticks"),
  # /
  "share": OneStep(
    "{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?",
    "/", (2, 9), (2, 12), {"item": _ITEMS}, "{item}"),
  "ribbon": OneStep(
    "A ribbon {a} centimeters long is cut into {b} equal pieces. How long is each piece in "
    "centimeters?", "/", (2, 9), (3, 15), unit="centimeters"),
  "teams": OneStep(
    "{a} students are split into teams of {b}. How many teams are there?",
    "/", (2, 8), (3, 12), unit="teams"),
  "notebooks": OneStep(
    "{name} paid ${a} for {b} identical notebooks. What was the price of one notebook in "
    "dollars?", "/", (2, 9), (2, 15), unit="dollars"),
  "pump": OneStep(
    "A pump fills {a} buckets in {b} minutes at a steady rate. How many buckets does it fill "
    "each minute?", "/", (2, 9), (2, 12), unit="buckets"),
  "packing": OneStep(
    "How many boxes does {name} need to pack {a} {item} if every box holds exactly {b}?",
    "/", (3, 12), (2, 9), {"item": _ITEMS}, "boxes"),
  "weekly": OneStep(
    "{name} saved the same amount each week and had ${a} after {b} weeks. How many dollars did "
    "{he} save per week?", "/", (2, 9), (3, 20), unit="dollars"),
  "book_days": OneStep(
    "A {a}-page book is read in {b} days, with the same number of pages every day. How many "
    "pages are read each day?", "/", (2, 9), (5, 25), unit="pages"),
  "chairs": OneStep(
    "The {a} chairs in a hall are set out in {b} equal rows. How many chairs are in each row?",
    "/", (3, 9), (4, 12), unit="chairs"),
}

# Never trained on: the held-out-phrasings split. Other scenarios and sentence shapes (a
# condition first, the question first or mid-sentence, ordinals, "still missing"), other verbs
# and units.
ONE_STEP_HELDOUT: dict[str, OneStep] = {
  # +
  "eggs_laid": OneStep(
    "A farmer collected {a} eggs in the morning. In the afternoon the hens laid another {b}. "
    "Counting both, how many eggs did the farmer collect that day?", "+", (10, 60), (5, 40),
    unit="eggs"),
  "choir": OneStep(
    "A choir has {a} sopranos and {b} altos. Adding the two sections, how large is the choir?",
    "+", (8, 40), (8, 40), unit="singers"),
  "sister_age": OneStep(
    "{name} was {a} years old when {his} sister was born. How old will {name} be on {his} "
    "sister's {b}th birthday?", "+", (2, 15), (4, 20), unit="years"),
  "river": OneStep(
    "Yesterday the river was {a} centimeters deep. After the storm it rose by another {b} "
    "centimeters. How deep is it today, in centimeters?", "+", (40, 90), (5, 30),
    unit="centimeters"),
  # -
  "juice": OneStep(
    "A jug held {a} milliliters of juice until {name} poured out {b} milliliters. What amount is "
    "in the jug now, in milliliters?", "-", (20, 90), (20, 90), unit="milliliters"),
  "no_shows": OneStep(
    "The theater sold {a} seats for tonight's show, but {b} ticket holders never arrived. "
    "Exactly how many people watched the show?", "-", (5, 40), (20, 80), unit="people"),
  "elevator": OneStep(
    "An elevator carrying {a} kilograms of boxes stops, and {b} kilograms are unloaded. With "
    "what load, in kilograms, does it continue?", "-", (20, 90), (20, 90), unit="kilograms"),
  "stamps_missing": OneStep(
    "{name} wants to collect {a} stamps for {his} album and is still missing {b}. So far, how "
    "many stamps has {he} collected?", "-", (5, 40), (10, 60), unit="stamps"),
  # *
  "heartbeat": OneStep(
    "A hummingbird's heart beats {a} times every second. Over {b} seconds, how many beats is "
    "that?", "*", (10, 20), (2, 9), unit="beats"),
  "butter": OneStep(
    "The recipe needs {b} grams of butter per cake. {name} is baking {a} cakes for the fair. "
    "How many grams of butter should {he} set aside?", "*", (2, 9), (10, 50), unit="grams"),
  "seed_packets": OneStep(
    "There are {b} seeds in every packet, and {name} opens {a} packets. What is the seed count?",
    "*", (2, 9), (5, 25), unit="seeds"),
  # /
  "party_tables": OneStep(
    "{a} guests are coming to a party, and {name} wants the same number at each of {b} tables. "
    "How many guests should sit at every table?", "/", (3, 9), (4, 10), unit="guests"),
  "rope_pieces": OneStep(
    "A length of rope measuring {a} feet yields pieces of {b} feet each. Into how many pieces "
    "can it be cut?", "/", (2, 9), (3, 12), unit="pieces"),
  "dinner_bill": OneStep(
    "Splitting a ${a} dinner bill evenly, {b} friends each pay the same share. What is each "
    "person's share in dollars?", "/", (2, 8), (5, 20), unit="dollars"),
}
# fmt: on
