"""Hypothesis strategies shared by the kinds of bad input."""

from __future__ import annotations

import json
import math

from hypothesis import strategies as st

TEXT = st.text(max_size=8)
LIST = st.lists(st.integers(-3, 3), max_size=3)
IDENT = st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True)
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
NEG_FLOAT = st.floats(max_value=-1e-6, allow_nan=False, allow_infinity=False)
NONPOS_FLOAT = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)
NONPOS_INT = st.integers(max_value=0)
NEG_INT = st.integers(max_value=-1)
NOT_INT = st.one_of(st.floats(), TEXT, st.none(), st.booleans(), LIST)


def not_in(allowed) -> st.SearchStrategy:
  """Short strings and identifiers outside ``allowed``."""
  return st.one_of(TEXT, IDENT).filter(lambda v: v not in allowed)


def not_json(text: str) -> bool:
  """Whether ``text`` fails to parse as JSON."""
  try:
    json.loads(text)
  except ValueError:
    return True
  return False


def not_object_json() -> st.SearchStrategy:
  """Encoded JSON that parses to anything but an object."""
  values = st.one_of(LIST, st.integers(), TEXT, st.none(), st.booleans())
  return values.map(lambda v: json.dumps(v).encode())
