"""The seeded random source word-problem templates draw from: people, integers and choices.

`Draw` wraps one ``numpy.random.Generator``; every name, number and noun of a generated word
problem (`knitjax.tasks.word_problem_templates`) comes from it, so the same generator state gives
the same problem. People are first names with the pronouns that go with them (`Person`).
"""

import numpy as np

_PEOPLE = (
  ("Tom", "he"),
  ("Maria", "she"),
  ("Sam", "he"),
  ("Lena", "she"),
  ("Omar", "he"),
  ("Priya", "she"),
  ("Jack", "he"),
  ("Mei", "she"),
  ("Carlos", "he"),
  ("Emma", "she"),
  ("Ben", "he"),
  ("Aisha", "she"),
  ("Leo", "he"),
  ("Nora", "she"),
  ("Ravi", "he"),
  ("Sofia", "she"),
  ("Max", "he"),
  ("Hana", "she"),
  ("Diego", "he"),
  ("Zoe", "she"),
  ("Ivan", "he"),
  ("Grace", "she"),
  ("Kofi", "he"),
  ("Lucy", "she"),
)
_PRONOUNS = {"he": ("he", "him", "his"), "she": ("she", "her", "her")}


class Person:
  """A named person and the pronouns that go with them."""

  def __init__(self, name: str, gender: str):
    self.name = name
    self.he, self.him, self.his = _PRONOUNS[gender]
    self.He, self.His = self.he.capitalize(), self.his.capitalize()


class Draw:
  """Draws from one numpy Generator: integers (inclusive bounds), choices and people."""

  def __init__(self, rng: np.random.Generator):
    self._rng = rng

  def int(self, lo: int, hi: int, step: int = 1) -> int:
    return lo + step * int(self._rng.integers((hi - lo) // step + 1))

  def pick(self, options: tuple):
    return options[int(self._rng.integers(len(options)))]

  def people(self, k: int) -> list[Person]:
    idx = self._rng.choice(len(_PEOPLE), size=k, replace=False)
    return [Person(*_PEOPLE[int(i)]) for i in idx]
