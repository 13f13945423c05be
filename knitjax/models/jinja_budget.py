"""A Jinja sandbox whose renders are bounded: the untrusted-template half of `chat_template`.

Every loop iteration, call, filter and arithmetic operation counts as a step (at most `MAX_STEPS`
per render, and `MAX_SECONDS` of wall time, checked at each step); strings, bytes and lists that
`*`, `+`, `%`, `~`, the size-changing filters and str methods build, and the rendered output, hold
at most `MAX_CHARS` items; `**` takes exponents up to `MAX_EXPONENT` and integers hold at most
`MAX_INT_BITS` bits; `lipsum` makes at most `MAX_LIPSUM_WORDS` words; a ``%`` or ``format``
pattern with a field width of 8+ digits is refused; `range` is jinja's sandboxed one (100,000
items at most). A render over a bound raises `TooBig`, whose message says which bound.

The deadline is checked between steps, so each step must be short: the operations that could run
for seconds on their own (a huge ``ljust``, ``lipsum(10**7)``, squaring a 10**5-digit integer) are
refused by their arguments before they run. A signal or thread deadline would not do: a signal
reaches only the main thread (templates render in rollout threads too) and waits for a C call such
as a big-integer product to return, and Python cannot stop a thread.
"""

import contextvars
import functools
import re
import time
from typing import Any

import jinja2
import jinja2.nodes
import jinja2.runtime
import jinja2.visitor
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Bounds of one render (see the module docstring). Real templates take a few hundred steps per
# message and render a few KB; a prompt of the longest context (1M tokens) is under 16M chars.
MAX_STEPS = 10_000_000
MAX_SECONDS = 10.0
MAX_CHARS = 1 << 24
MAX_EXPONENT = 10_000
MAX_INT_BITS = 1 << 16  # 7 ** 9999 (28,000 bits) is accepted, its square's square is not
MAX_LIPSUM_WORDS = 100_000  # lipsum(n, max=...) writes up to n * max words, 2 us each
_GUARD_FILTER = "knitjax guard"  # not a name a template can write: only the loop rewrite uses it
_CONCAT_FILTER = "knitjax concat"
# A field width or precision of 8+ digits in a % or str.format pattern (e.g. "%099999999d").
_HUGE_WIDTH = re.compile(r"\d{8,}")
_SEQUENCES = (str, bytes, bytearray, list, tuple)


class _RenderBudget:
  """The steps and the deadline of one render."""

  def __init__(self):
    self.steps = 0
    self.deadline = time.monotonic() + MAX_SECONDS

  def step(self, n: int = 1) -> None:
    self.steps += n
    if self.steps > MAX_STEPS:
      raise TooBig(f"it took more than {MAX_STEPS:,} steps (loop iterations, calls, operations)")
    # At every step (~70 ns, 0.7 s over MAX_STEPS): a step is short, its sizes bounded, but a
    # loop of 1,000 half-second steps between checks would outlast the deadline many times over.
    if time.monotonic() > self.deadline:
      raise TooBig(f"it ran for more than {MAX_SECONDS:g} s")


class TooBig(Exception):
  """A render over one of the bounds; the message says which."""


_BUDGET: contextvars.ContextVar[_RenderBudget] = contextvars.ContextVar("chat_template_budget")


def _step(n: int = 1) -> None:
  _BUDGET.get().step(n)


def _too_long(value: Any) -> "TooBig":
  """``it built a str of more than 16,777,216 items`` (``bytes`` for bytes)."""
  kind = "bytes" if isinstance(value, (bytes, bytearray)) else f"a {type(value).__name__}"
  return TooBig(f"it built {kind} of more than {MAX_CHARS:,} items")


def _check_size(value: Any) -> Any:
  if isinstance(value, _SEQUENCES) and len(value) > MAX_CHARS:
    raise _too_long(value)
  return value


@jinja2.pass_context  # never folded at compile time: it runs inside a render's budget
def _guarded_iter(_context, iterable):
  """A loop's iterable, one step per item."""
  for item in iterable:
    _step()
    yield item


@jinja2.pass_context
def _guarded_concat(_context, parts):
  """``a ~ b``: bounded like the output."""
  size = 0
  out = []
  for p in parts:
    text = p if isinstance(p, str) else jinja2.runtime.soft_str(p)
    size += len(text)
    if size > MAX_CHARS:
      raise TooBig(f"it built a str of more than {MAX_CHARS:,} items")
    out.append(text)
  return "".join(out)


class _GuardLoops(jinja2.visitor.NodeTransformer):
  """Routes every ``for`` loop's iterable and every ``~`` through the render budget."""

  def visit_For(self, node):  # noqa: N802 -- jinja's visitor naming
    node = self.generic_visit(node)
    node.iter = jinja2.nodes.Filter(node.iter, _GUARD_FILTER, [], [], None, None)
    return node

  def visit_Concat(self, node):  # noqa: N802
    node = self.generic_visit(node)
    return jinja2.nodes.Filter(
      jinja2.nodes.List(node.nodes), _CONCAT_FILTER, [], [], None, None
    ).set_lineno(node.lineno)


def _sized_repeat(left: Any, right: Any) -> None:
  """Refuses ``seq * n`` (either order) before it is built when it would be too long."""
  for seq, n in ((left, right), (right, left)):
    if isinstance(seq, _SEQUENCES) and isinstance(n, int) and len(seq) * n > MAX_CHARS:
      raise _too_long(seq)


def _int_bits(operator_name: str, left: Any, right: Any) -> None:
  """Refuses ``a * b`` and ``a ** b`` of integers before they are computed when the result would
  pass `MAX_INT_BITS` (multiplying such numbers takes seconds, and squaring doubles them)."""
  if not (isinstance(left, int) and isinstance(right, int)):
    return
  if operator_name == "*":
    bits = left.bit_length() + right.bit_length()
  elif operator_name == "**" and right > 0:
    bits = max(left.bit_length() - 1, 0) * right  # 0 ** n, 1 ** n and (-1) ** n stay small
  else:
    return
  if bits > MAX_INT_BITS:
    raise TooBig(f"it built an integer of more than {MAX_INT_BITS:,} bits")


def _size(value: Any) -> int:
  return len(value) if isinstance(value, _SEQUENCES) else 0


def _check_pattern(pattern: Any) -> None:
  if isinstance(pattern, str) and _HUGE_WIDTH.search(pattern):
    raise TooBig("it formats with a field width or precision of 8 digits or more")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
  """The sandbox with every loop, call and arithmetic operation counted and sized."""

  intercepted_binops = frozenset(["+", "*", "**", "%", "//", "/"])
  intercepted_unops = frozenset()

  def _parse(self, source, name, filename):
    return _GuardLoops().visit(super()._parse(source, name, filename))

  def call_binop(self, context, operator_name, left, right):
    _step()
    if operator_name == "*":
      _sized_repeat(left, right)
    elif operator_name == "**":
      if isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
        raise TooBig(f"it raised to a power above {MAX_EXPONENT:,}")
    elif operator_name == "%":
      _check_pattern(left)
    elif operator_name == "+" and _size(left) + _size(right) > MAX_CHARS:
      raise _too_long(left)
    _int_bits(operator_name, left, right)
    return _check_size(super().call_binop(context, operator_name, left, right))

  def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 -- the sandbox's signature
    _step()
    _call_precheck(__obj, args, kwargs)
    return _check_size(super().call(__context, __obj, *args, **kwargs))

  def wrap_str_format(self, value):
    wrapped = super().wrap_str_format(value)
    if wrapped is not None:
      _check_pattern(value.__self__)  # at access: the sandbox's wrapper hides the pattern
    return wrapped


def _call_precheck(obj: Any, args: tuple, kwargs: dict) -> None:
  """Refuses, before they run, ``lipsum`` and str / bytes method calls whose result would pass a
  bound (``'x'.ljust(10**9)`` allocates a GB before its size could be checked)."""

  def arg(i, key, default=None):
    return args[i] if len(args) > i else kwargs.get(key, default)

  if obj is jinja2.utils.generate_lorem_ipsum:
    n, most = arg(0, "n", 5), arg(3, "max", 100)
    if isinstance(n, int) and isinstance(most, int) and n * most > MAX_LIPSUM_WORDS:
      raise TooBig(f"it asked lipsum for more than {MAX_LIPSUM_WORDS:,} words")
    return
  value, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
  if isinstance(value, int) and name == "to_bytes":
    size = arg(0, "length", 1)
  elif not isinstance(value, (str, bytes, bytearray)):
    return
  elif name in ("ljust", "rjust", "center", "zfill"):
    size = arg(0, "width", 0)
  elif name == "expandtabs":
    tabsize = arg(0, "tabsize", 8)
    size = len(value) + value.count("\t" if isinstance(value, str) else b"\t") * tabsize
  elif name == "replace" and len(args) >= 2:
    old, new = args[0], args[1]
    hits = len(value) + 1 if not old else value.count(old)
    size = len(value) + hits * max(len(new) - len(old), 0)
  elif name == "join" and isinstance(args[0] if args else None, (list, tuple)):
    size = sum(map(_size, args[0])) + len(value) * len(args[0])
  elif name == "encode":
    size = 4 * len(value)  # UTF-8: at most 4 bytes a character
  else:
    return
  if isinstance(size, int) and size > MAX_CHARS:
    raise _too_long(b"" if name == "to_bytes" else value)


def _filter_precheck(name: str, args: tuple, kwargs: dict) -> None:
  """Refuses, before they run, filter calls whose result would pass `MAX_CHARS`."""

  def arg(i, key, default=None):
    return args[i] if len(args) > i else kwargs.get(key, default)

  value = args[0] if args else None
  if name == "center":
    width = arg(1, "width", 80)
    if isinstance(width, int) and width > MAX_CHARS:
      raise TooBig(f"it centers in a width of more than {MAX_CHARS:,} characters")
  elif name == "indent" and isinstance(value, str):
    width = arg(1, "width", 4)
    width = len(width) if isinstance(width, str) else width
    if isinstance(width, int) and len(value) + width * (value.count("\n") + 1) > MAX_CHARS:
      raise TooBig(f"it built a str of more than {MAX_CHARS:,} items")
  elif name == "replace" and isinstance(value, str):
    old, new = str(arg(1, "old", "")), str(arg(2, "new", ""))
    hits = len(value) + 1 if not old else value.count(old)
    if len(value) + hits * max(len(new) - len(old), 0) > MAX_CHARS:
      raise TooBig(f"it built a str of more than {MAX_CHARS:,} items")
  elif name == "format":
    _check_pattern(value)
  elif name == "tojson":
    indent = arg(2, "indent")
    if isinstance(indent, int) and indent > 64:
      raise TooBig("it indents JSON by more than 64 spaces")


def bounded_filter(name: str, f):
  """A filter that counts as a step, is checked before it runs, and sized after."""

  @functools.wraps(f)  # keeps jinja's pass_context / pass_eval_context marks
  def bounded(*args, **kwargs):
    _step()
    marked = getattr(f, "jinja_pass_arg", None) is not None
    _filter_precheck(name, args[1:] if marked else args, kwargs)
    return _check_size(f(*args, **kwargs))

  return bounded


def bound_filters(env: jinja2.Environment) -> None:
  """Makes every filter of ``env`` a bounded one, and adds the two the loop rewrite uses."""
  env.filters = {name: bounded_filter(name, f) for name, f in env.filters.items()}
  env.filters[_GUARD_FILTER] = _guarded_iter
  env.filters[_CONCAT_FILTER] = _guarded_concat


def render(template: jinja2.Template, **variables: Any) -> str:
  """Renders ``template`` (compiled by a `BoundedEnvironment`) within one render's budget.

  Raises:
    TooBig: the render passed a bound.
  """
  token = _BUDGET.set(_RenderBudget())
  try:
    out, size = [], 0
    for piece in template.generate(**variables):
      size += len(piece)
      if size > MAX_CHARS:
        raise TooBig(f"its output passed {MAX_CHARS:,} characters")
      _step()
      out.append(piece)
    return "".join(out)
  finally:
    _BUDGET.reset(token)
