"""The word-problem templates: each draws its numbers and writes a question and its worked steps.

A template takes a `Draw` (`knitjax.tasks.word_problem_draws`) and returns ``(question, solution
steps, integer answer)``; every step is one sentence holding one equation such as ``4 * 3 = 12``,
and the last step's result is the answer. The templates (shopping and change, rates and time,
sharing, multi-step sums and products, percentages, ages, areas and perimeters, unit
conversions) take 1-3 steps with small numbers and printable-ASCII text. `TEMPLATES` names them;
`knitjax.tasks.word_problems` draws records from it.
"""

import math
from collections.abc import Callable

from knitjax.tasks.word_problem_draws import Draw

_SHOP_ITEMS = ("pens", "notebooks", "apples", "stickers", "cupcakes", "toy cars", "books", "mugs")
_SMALL_ITEMS = ("marbles", "cookies", "stickers", "crayons", "cards", "grapes", "beads", "stamps")
_BAKED = ("muffins", "cookies", "rolls", "cupcakes", "bagels")
_VEHICLES = ("train", "car", "bus", "truck", "boat")
_PLACES = ("garden", "yard", "field", "pen", "patio")

# A template draws its numbers and returns (question, solution steps, integer answer).
Template = Callable[[Draw], tuple[str, list[str], int]]


def _change(d: Draw):
  (p,) = d.people(1)
  item, k, price = d.pick(_SHOP_ITEMS), d.int(2, 6), d.int(2, 9)
  cost = k * price
  bill = d.pick(tuple(b for b in (10, 20, 50, 100) if b > cost))
  q = (
    f"{p.name} buys {k} {item} for ${price} each and pays with a ${bill} bill. "
    f"How much change, in dollars, does {p.he} get?"
  )
  steps = [
    f"The {item} cost {k} * {price} = {cost} dollars.",
    f"The change is {bill} - {cost} = {bill - cost} dollars.",
  ]
  return q, steps, bill - cost


def _speed(d: Draw):
  vehicle, speed, hours = d.pick(_VEHICLES), d.int(20, 80, 5), d.int(2, 6)
  q = (
    f"A {vehicle} travels at {speed} miles per hour. "
    f"How many miles does it travel in {hours} hours?"
  )
  return q, [f"It travels {speed} * {hours} = {speed * hours} miles."], speed * hours


def _reading(d: Draw):
  (p,) = d.people(1)
  per_day, days = d.int(5, 30, 5), d.int(3, 12)
  total = per_day * days
  q = (
    f"{p.name} reads {per_day} pages every day. How many days does it take {p.him} to read a "
    f"book with {total} pages?"
  )
  return q, [f"It takes {total} / {per_day} = {days} days."], days


def _tank(d: Draw):
  rate, minutes = d.int(2, 12), d.int(3, 15)
  total = rate * minutes
  q = (
    f"A tap fills a tank with {rate} liters of water per minute. How many minutes does it take "
    f"to fill a tank that holds {total} liters?"
  )
  return q, [f"It takes {total} / {rate} = {minutes} minutes."], minutes


def _wages(d: Draw):
  (p,) = d.people(1)
  wage, hours, days = d.int(8, 20), d.int(2, 8), d.int(2, 6)
  daily = wage * hours
  q = (
    f"{p.name} earns ${wage} per hour. {p.He} works {hours} hours a day for {days} days. "
    f"How many dollars does {p.he} earn in total?"
  )
  steps = [
    f"Each day {p.he} earns {wage} * {hours} = {daily} dollars.",
    f"In {days} days {p.he} earns {daily} * {days} = {daily * days} dollars.",
  ]
  return q, steps, daily * days


def _share(d: Draw):
  (p,) = d.people(1)
  item, friends, each = d.pick(_SMALL_ITEMS), d.int(2, 8), d.int(2, 12)
  total = friends * each
  q = (
    f"{p.name} has {total} {item} and shares them equally among {friends} friends. "
    f"How many {item} does each friend get?"
  )
  return q, [f"Each friend gets {total} / {friends} = {each} {item}."], each


def _keep_and_share(d: Draw):
  (p,) = d.people(1)
  item, keep, friends, each = d.pick(_SMALL_ITEMS), d.int(2, 10), d.int(2, 6), d.int(2, 9)
  rest = friends * each
  total = keep + rest
  q = (
    f"{p.name} has {total} {item}. {p.He} keeps {keep} for {p.him}self and shares the rest "
    f"equally among {friends} friends. How many {item} does each friend get?"
  )
  steps = [
    f"{p.He} shares {total} - {keep} = {rest} {item}.",
    f"Each friend gets {rest} / {friends} = {each} {item}.",
  ]
  return q, steps, each


def _bake_and_sell(d: Draw):
  (p,) = d.people(1)
  item, per_box, boxes, price = d.pick(_BAKED), d.int(4, 12), d.int(2, 9), d.int(3, 10)
  total = per_box * boxes
  q = (
    f"{p.name} bakes {total} {item} and packs them in boxes of {per_box}. {p.He} sells each "
    f"box for ${price}. How many dollars does {p.he} get for all the boxes?"
  )
  steps = [
    f"{p.He} packs {total} / {per_box} = {boxes} boxes.",
    f"{p.He} gets {boxes} * {price} = {boxes * price} dollars.",
  ]
  return q, steps, boxes * price


def _boxes_plus(d: Draw):
  (p,) = d.people(1)
  item, boxes, per_box, had = d.pick(_SMALL_ITEMS), d.int(2, 8), d.int(3, 12), d.int(1, 20)
  bought = boxes * per_box
  q = (
    f"{p.name} has {had} {item}. {p.He} buys {boxes} boxes of {item} with {per_box} {item} in "
    f"each box. How many {item} does {p.he} have now?"
  )
  steps = [
    f"{p.He} buys {boxes} * {per_box} = {bought} {item}.",
    f"{p.He} has {had} + {bought} = {had + bought} {item}.",
  ]
  return q, steps, had + bought


def _give_away(d: Draw):
  (p,) = d.people(1)
  item, red, blue = d.pick(_SMALL_ITEMS), d.int(5, 30), d.int(5, 30)
  gave = d.int(1, red + blue - 1)
  q = (
    f"{p.name} has {red} red {item} and {blue} blue {item}. {p.He} gives away {gave} of them. "
    f"How many {item} does {p.he} have left?"
  )
  steps = [
    f"{p.He} has {red} + {blue} = {red + blue} {item}.",
    f"{p.He} has {red + blue} - {gave} = {red + blue - gave} left.",
  ]
  return q, steps, red + blue - gave


def _fewer_together(d: Draw):
  a, b = d.people(2)
  item, have, fewer = d.pick(_SMALL_ITEMS), d.int(10, 40), d.int(1, 9)
  other = have - fewer
  q = (
    f"{a.name} has {have} {item}. {b.name} has {fewer} fewer {item} than {a.name}. "
    f"How many {item} do they have together?"
  )
  steps = [
    f"{b.name} has {have} - {fewer} = {other} {item}.",
    f"Together they have {have} + {other} = {have + other} {item}.",
  ]
  return q, steps, have + other


def _legs(d: Draw):
  cows, hens = d.int(2, 12), d.int(2, 15)
  q = f"A farmer has {cows} cows and {hens} hens. How many legs do the animals have in total?"
  steps = [
    f"The cows have {cows} * 4 = {4 * cows} legs.",
    f"The hens have {hens} * 2 = {2 * hens} legs.",
    f"In total there are {4 * cows} + {2 * hens} = {4 * cows + 2 * hens} legs.",
  ]
  return q, steps, 4 * cows + 2 * hens


def _savings(d: Draw):
  (p,) = d.people(1)
  item = d.pick(("bike", "tent", "guitar", "scooter", "camera"))
  saved, weekly, weeks = d.int(5, 40), d.int(5, 15), d.int(2, 8)
  cost = saved + weekly * weeks
  q = (
    f"{p.name} wants a {item} that costs ${cost}. {p.He} has saved ${saved} and saves ${weekly} "
    f"more each week. How many weeks does {p.he} need to save to buy it?"
  )
  steps = [
    f"{p.He} still needs {cost} - {saved} = {cost - saved} dollars.",
    f"That takes {cost - saved} / {weekly} = {weeks} weeks.",
  ]
  return q, steps, weeks


def _percent_unit(pct: int) -> int:
  """Smallest whole number whose ``pct`` percent is a whole number."""
  return 100 // math.gcd(pct, 100)


def _sale(d: Draw):
  item, pct = (
    d.pick(("jacket", "lamp", "game", "backpack", "chair", "watch")),
    d.pick((10, 20, 25, 50)),
  )
  unit = _percent_unit(pct)
  price = unit * d.int(max(1, 20 // unit), 200 // unit)
  off = price * pct // 100
  q = (
    f"A {item} costs ${price}. It is on sale for {pct}% off. "
    f"What is the sale price of the {item} in dollars?"
  )
  steps = [
    f"The discount is {price} * {pct} / 100 = {off} dollars.",
    f"The sale price is {price} - {off} = {price - off} dollars.",
  ]
  return q, steps, price - off


def _percent_of(d: Draw):
  pct = d.pick((10, 20, 25, 50, 75))
  unit = _percent_unit(pct)
  students = unit * d.int(max(1, 12 // unit), 40 // unit)
  part = students * pct // 100
  q = (
    f"There are {students} students in a class. {pct}% of them walk to school. "
    f"How many students walk to school?"
  )
  return q, [f"{students} * {pct} / 100 = {part} students walk."], part


def _age_later(d: Draw):
  a, b = d.people(2)
  age, older, years = d.int(5, 15), d.int(2, 10), d.int(2, 10)
  now = age + older
  q = (
    f"{a.name} is {age} years old. {b.name} is {older} years older than {a.name}. "
    f"How old will {b.name} be in {years} years?"
  )
  steps = [
    f"{b.name} is {age} + {older} = {now} years old now.",
    f"In {years} years {b.he} will be {now} + {years} = {now + years}.",
  ]
  return q, steps, now + years


def _age_times(d: Draw):
  (p,) = d.people(1)
  age, times = d.int(4, 12), d.int(3, 5)
  mother = age * times
  q = (
    f"{p.name} is {age} years old. {p.His} mother is {times} times as old as {p.him}. "
    f"How many years older than {p.name} is {p.his} mother?"
  )
  steps = [
    f"The mother is {age} * {times} = {mother} years old.",
    f"She is {mother} - {age} = {mother - age} years older.",
  ]
  return q, steps, mother - age


def _area(d: Draw):
  place, length, width = d.pick(_PLACES), d.int(3, 20), d.int(2, 15)
  q = (
    f"A rectangular {place} is {length} meters long and {width} meters wide. "
    f"What is its area in square meters?"
  )
  return q, [f"The area is {length} * {width} = {length * width} square meters."], length * width


def _fence(d: Draw):
  (p,) = d.people(1)
  place, length, width = d.pick(_PLACES), d.int(3, 20), d.int(2, 15)
  half = length + width
  q = (
    f"{p.name} puts a fence around a rectangular {place} that is {length} feet long and {width} "
    f"feet wide. How many feet of fence does {p.he} need?"
  )
  steps = [
    f"One length and one width are {length} + {width} = {half} feet.",
    f"The fence is 2 * {half} = {2 * half} feet.",
  ]
  return q, steps, 2 * half


def _carpet(d: Draw):
  side, price = d.int(3, 9), d.int(2, 12)
  area = side * side
  q = (
    f"A square room has sides of {side} meters. Carpet costs ${price} per square meter. "
    f"How many dollars does it cost to carpet the room?"
  )
  steps = [
    f"The room is {side} * {side} = {area} square meters.",
    f"The carpet costs {area} * {price} = {area * price} dollars.",
  ]
  return q, steps, area * price


def _meters(d: Draw):
  (p,) = d.people(1)
  km = d.int(2, 9)
  q = f"{p.name} runs {km} kilometers. How many meters does {p.he} run?"
  return q, [f"{km} * 1000 = {km * 1000} meters."], km * 1000


def _minutes(d: Draw):
  hours, minutes = d.int(1, 3), d.int(5, 55, 5)
  q = f"A movie is {hours} hours and {minutes} minutes long. How many minutes long is the movie?"
  steps = [
    f"{hours} hours are {hours} * 60 = {hours * 60} minutes.",
    f"The movie is {hours * 60} + {minutes} = {hours * 60 + minutes} minutes long.",
  ]
  return q, steps, hours * 60 + minutes


def _rope(d: Draw):
  (p,) = d.people(1)
  feet, cut = d.int(2, 12), d.int(2, 11)
  inches = feet * 12
  q = (
    f"A rope is {feet} feet long. {p.name} cuts off {cut} inches. How many inches of rope are left?"
  )
  steps = [
    f"The rope is {feet} * 12 = {inches} inches long.",
    f"{inches} - {cut} = {inches - cut} inches are left.",
  ]
  return q, steps, inches - cut


def _eggs(d: Draw):
  (p,) = d.people(1)
  dozens = d.int(2, 5)
  used = d.int(1, dozens * 12 - 1)
  q = f"{p.name} buys {dozens} dozen eggs and uses {used} of them. How many eggs are left?"
  steps = [
    f"{p.He} buys {dozens} * 12 = {dozens * 12} eggs.",
    f"{dozens * 12} - {used} = {dozens * 12 - used} eggs are left.",
  ]
  return q, steps, dozens * 12 - used


def _trip_days(d: Draw):
  (p,) = d.people(1)
  weeks, days = d.int(2, 6), d.int(1, 6)
  q = f"{p.name} goes on a trip for {weeks} weeks and {days} days. How many days long is the trip?"
  steps = [
    f"{weeks} weeks are {weeks} * 7 = {weeks * 7} days.",
    f"The trip is {weeks * 7} + {days} = {weeks * 7 + days} days long.",
  ]
  return q, steps, weeks * 7 + days


TEMPLATES: dict[str, Template] = {
  "change": _change,
  "speed": _speed,
  "reading": _reading,
  "tank": _tank,
  "wages": _wages,
  "share": _share,
  "keep_and_share": _keep_and_share,
  "bake_and_sell": _bake_and_sell,
  "boxes_plus": _boxes_plus,
  "give_away": _give_away,
  "fewer_together": _fewer_together,
  "legs": _legs,
  "savings": _savings,
  "sale": _sale,
  "percent_of": _percent_of,
  "age_later": _age_later,
  "age_times": _age_times,
  "area": _area,
  "fence": _fence,
  "carpet": _carpet,
  "meters": _meters,
  "minutes": _minutes,
  "rope": _rope,
  "eggs": _eggs,
  "trip_days": _trip_days,
}
