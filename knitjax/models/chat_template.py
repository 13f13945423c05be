"""Chat templates: find a model's Jinja template and render it the way `transformers` does.

`transformers`' ``apply_chat_template`` renders the template in an immutable Jinja sandbox with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` tag,
a ``tojson`` filter that does not escape HTML, and the globals ``raise_exception``,
``strftime_now``, ``dict`` and ``namespace`` (``transformers/utils/chat_template_utils.py``).
This module mirrors that environment with jinja2 alone, so a prompt rendered here is the prompt the
model was trained on, byte for byte, without importing `transformers`.

A template comes with a model folder, so it is untrusted input: rendering is bounded. Every loop
iteration, call and arithmetic operation counts as a step (at most `MAX_STEPS` per render, and
`MAX_SECONDS` of wall time, checked at each step); strings and lists that `*`, `+`, `%` and `~`
build, and the rendered output, hold at most `MAX_CHARS` characters; `**` takes exponents up to
`MAX_EXPONENT`; `range` is jinja's sandboxed one (100,000 items at most). Whatever a template does
(`{{ 1/0 }}`, a macro that calls itself, `{{ 'x' * 10**12 }}`, loops nested 10**10 deep), the
render ends with one sentence naming the template, a `ChatTemplateError`.
"""

import contextvars
import functools
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import jinja2.visitor
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# The names a message's reasoning travels under; transformers fills all of them from any one.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Bounds of one render (see the module docstring). Real templates take a few hundred steps per
# message and render a few KB; a prompt of the longest context (1M tokens) is under 16M chars.
MAX_STEPS = 10_000_000
MAX_SECONDS = 10.0
MAX_CHARS = 1 << 24
MAX_EXPONENT = 10_000
_GUARD_FILTER = "knitjax guard"  # not a name a template can write: only the loop rewrite uses it
_CONCAT_FILTER = "knitjax concat"
# A field width or precision of 8+ digits in a % or str.format pattern (e.g. "%099999999d").
_HUGE_WIDTH = re.compile(r"\d{8,}")


class ChatTemplateError(ValueError):
  """A chat template that does not compile, or that fails or calls ``raise_exception``."""


class _GenerationTag(jinja2.ext.Extension):
  """``{% generation %}...{% endgeneration %}`` marks assistant text; its body renders as is."""

  tags = {"generation"}

  def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

  def _render_body(self, caller) -> str:
    return caller()


class _TemplateDict:
  """``dict(...)`` inside a template, without exposing the ``dict`` type itself."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
  """``namespace(...)`` that refuses underscore-prefixed attributes (no reach into internals)."""

  def __init__(*args, **kwargs):  # noqa: N805 -- jinja's signature trick, so namespace(self=...) works
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _TemplateNamespace._check_name(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _TemplateNamespace._check_name(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check_name(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(
        f"chat templates cannot store the underscore-prefixed attribute {name!r} on a namespace"
      )


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # Jinja's own tojson escapes HTML characters (<, >, &, '); transformers' does not.
  return json.dumps(
    x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


def _strftime_now(format):  # noqa: A002 -- the name templates call it with
  return datetime.now().strftime(format)


class _RenderBudget:
  """The steps and the deadline of one render."""

  def __init__(self):
    self.steps = 0
    self.deadline = time.monotonic() + MAX_SECONDS

  def step(self, n: int = 1) -> None:
    self.steps += n
    if self.steps > MAX_STEPS:
      raise _TooBig(f"it took more than {MAX_STEPS:,} steps (loop iterations, calls, operations)")
    if not self.steps & 0x3FF and time.monotonic() > self.deadline:
      raise _TooBig(f"it ran for more than {MAX_SECONDS:g} s")


class _TooBig(Exception):
  """A render over one of the bounds; the message says which."""


_BUDGET: contextvars.ContextVar[_RenderBudget] = contextvars.ContextVar("chat_template_budget")


def _step(n: int = 1) -> None:
  _BUDGET.get().step(n)


def _check_size(value: Any) -> Any:
  if isinstance(value, (str, list, tuple)) and len(value) > MAX_CHARS:
    raise _TooBig(f"it built a {type(value).__name__} of more than {MAX_CHARS:,} items")
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
      raise _TooBig(f"it built a str of more than {MAX_CHARS:,} items")
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
    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_CHARS:
      raise _TooBig(f"it built a {type(seq).__name__} of more than {MAX_CHARS:,} items")


def _size(value: Any) -> int:
  return len(value) if isinstance(value, (str, list, tuple)) else 0


def _check_pattern(pattern: Any) -> None:
  if isinstance(pattern, str) and _HUGE_WIDTH.search(pattern):
    raise _TooBig("it formats with a field width or precision of 8 digits or more")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
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
        raise _TooBig(f"it raised to a power above {MAX_EXPONENT:,}")
    elif operator_name == "%":
      _check_pattern(left)
    elif operator_name == "+" and _size(left) + _size(right) > MAX_CHARS:
      raise _TooBig(f"it built a {type(left).__name__} of more than {MAX_CHARS:,} items")
    return _check_size(super().call_binop(context, operator_name, left, right))

  def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 -- the sandbox's signature
    _step()
    return _check_size(super().call(__context, __obj, *args, **kwargs))

  def wrap_str_format(self, value):
    wrapped = super().wrap_str_format(value)
    if wrapped is not None:
      _check_pattern(value.__self__)  # at access: the sandbox's wrapper hides the pattern
    return wrapped


def _filter_precheck(name: str, args: tuple, kwargs: dict) -> None:
  """Refuses, before they run, filter calls whose result would pass `MAX_CHARS`."""

  def arg(i, key, default=None):
    return args[i] if len(args) > i else kwargs.get(key, default)

  value = args[0] if args else None
  if name == "center":
    width = arg(1, "width", 80)
    if isinstance(width, int) and width > MAX_CHARS:
      raise _TooBig(f"it centers in a width of more than {MAX_CHARS:,} characters")
  elif name == "indent" and isinstance(value, str):
    width = arg(1, "width", 4)
    width = len(width) if isinstance(width, str) else width
    if isinstance(width, int) and len(value) + width * (value.count("\n") + 1) > MAX_CHARS:
      raise _TooBig(f"it built a str of more than {MAX_CHARS:,} items")
  elif name == "replace" and isinstance(value, str):
    old, new = str(arg(1, "old", "")), str(arg(2, "new", ""))
    hits = len(value) + 1 if not old else value.count(old)
    if len(value) + hits * max(len(new) - len(old), 0) > MAX_CHARS:
      raise _TooBig(f"it built a str of more than {MAX_CHARS:,} items")
  elif name == "format":
    _check_pattern(value)
  elif name == "tojson":
    indent = arg(2, "indent")
    if isinstance(indent, int) and indent > 64:
      raise _TooBig("it indents JSON by more than 64 spaces")


def _bounded_filter(name: str, f):
  """A filter that counts as a step, is checked before it runs, and sized after."""

  @functools.wraps(f)  # keeps jinja's pass_context / pass_eval_context marks
  def bounded(*args, **kwargs):
    _step()
    marked = getattr(f, "jinja_pass_arg", None) is not None
    _filter_precheck(name, args[1:] if marked else args, kwargs)
    return _check_size(f(*args, **kwargs))

  return bounded


@functools.lru_cache(maxsize=16)
def _compile(template: str, origin: str) -> jinja2.Template:
  env = _BoundedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
  env.filters[_GUARD_FILTER] = _guarded_iter
  env.filters[_CONCAT_FILTER] = _guarded_concat
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  env.globals["dict"] = _TemplateDict()
  env.globals["namespace"] = _TemplateNamespace
  try:
    return env.from_string(template)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise ChatTemplateError(
      f"{origin} has a Jinja syntax error at line {e.lineno}: {_end_sentence(e.message)}"
    ) from None


def _end_sentence(message: str | None) -> str:
  """``message`` as the end of a sentence: stripped, with a full stop unless it has one."""
  message = (message or "unknown error").strip()
  return message if message.endswith((".", "!", "?")) else message + "."


def _plain(value: Any) -> Any:
  """A deep copy of ``value`` in plain JSON types, as transformers gives the template."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  if isinstance(value, str):
    return str.__str__(value)
  if isinstance(value, int):
    return int.__int__(value)
  if isinstance(value, float):
    return float.__float__(value)
  if isinstance(value, Mapping):
    return {_plain(k): _plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_plain(v) for v in value]
  if isinstance(value, tuple):
    return tuple(_plain(v) for v in value)
  if isinstance(value, np.generic):  # np.bool_(False) must not become a truthy placeholder
    return _plain(value.item())
  return f"<{type(value).__name__}>"


def _prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
    raise ChatTemplateError("messages must be a non-empty list of dicts with 'role' and 'content'.")
  out = []
  for i, message in enumerate(messages):
    if not isinstance(message, Mapping):
      raise ChatTemplateError(
        f"message {i} is a {type(message).__name__}; each message must be a dict with 'role' and "
        "'content'."
      )
    # transformers drops None values (an API's content=None) and aliases the reasoning fields.
    message = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
      message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    out.append(message)
  return out


class ChatTemplate:
  """A compiled chat template; ``origin`` names where it came from in error messages."""

  def __init__(self, template: str, origin: str = "the chat template"):
    if not isinstance(template, str):
      raise ChatTemplateError(f"{origin} is a {type(template).__name__}; it must be a string.")
    self.source = template
    self.origin = origin
    self._template = _compile(template, origin)

  def render(
    self,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **variables: Any,
  ) -> str:
    """Renders ``messages``; ``variables`` (special tokens, ``date_string``...) reach the template.

    A variable whose value is None is left undefined, as transformers leaves a special token the
    tokenizer does not have: ``{{ bos_token }}`` then renders as "" rather than "None".

    Raises:
      ChatTemplateError: (a ValueError) when the template fails or calls ``raise_exception``.
    """
    chat = _prepare_messages(messages)
    kwargs = {k: _plain(v) for k, v in variables.items() if v is not None}
    token = _BUDGET.set(_RenderBudget())
    try:
      out, size = [], 0
      for piece in self._template.generate(
        messages=chat,
        tools=_plain(tools),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **kwargs,
      ):
        size += len(piece)
        if size > MAX_CHARS:
          raise _TooBig(f"its output passed {MAX_CHARS:,} characters")
        _step()
        out.append(piece)
      return "".join(out)
    except _TooBig as e:
      raise ChatTemplateError(f"{self.origin} was stopped: {e}.") from None
    except jinja2.exceptions.TemplateError as e:
      reason = _end_sentence(e.message)
      raise ChatTemplateError(f"{self.origin} refused the messages: {reason}") from None
    except RecursionError:
      raise ChatTemplateError(
        f"{self.origin} failed on the messages: it recursed too deeply (a macro calling itself?)."
      ) from None
    except MemoryError:
      raise ChatTemplateError(f"{self.origin} failed on the messages: out of memory.") from None
    except Exception as e:  # noqa: BLE001 -- any error of a template is the template's
      raise ChatTemplateError(
        f"{self.origin} failed on the messages with {type(e).__name__}: {_end_sentence(str(e))}"
      ) from None
    finally:
      _BUDGET.reset(token)


def render_chat_template(
  template: str,
  messages: Sequence[Mapping[str, Any]],
  *,
  bos_token: str | None,
  eos_token: str | None,
  add_generation_prompt: bool,
  **extra: Any,
) -> str:
  """Renders ``messages`` with the Jinja ``template`` exactly as transformers' apply_chat_template.

  Args:
    template: the Jinja source.
    messages: dicts with "role" and "content" (and whatever else the template reads).
    bos_token: the BOS token's text, or None when the tokenizer has none (left undefined).
    eos_token: the EOS token's text, or None.
    add_generation_prompt: end with the header that starts an assistant turn.
    **extra: further template variables (``unk_token``, ``pad_token``, ``tools``, ``date_string``,
      ``enable_thinking``...); they override the special tokens, as in transformers.

  Returns:
    The rendered prompt text.

  Raises:
    ValueError: one sentence, when the template does not compile, fails, or calls
      ``raise_exception``.
  """
  variables = {"bos_token": bos_token, "eos_token": eos_token, **extra}
  return ChatTemplate(template).render(
    messages, add_generation_prompt=add_generation_prompt, **variables
  )


def select_chat_template(value: Any, origin: str) -> str | None:
  """Returns the template text from a ``chat_template`` config value (a string or named list)."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list):
    named = {}
    for entry in value:
      if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)):
        raise ChatTemplateError(
          f"{origin} is a list whose entries must be {{'name': ..., 'template': ...}} dicts."
        )
      named[entry["name"]] = entry.get("template")
    if not isinstance(named.get("default"), str):
      raise ChatTemplateError(
        f"{origin} lists templates {sorted(named)} but none named 'default' with a string template."
      )
    return named["default"]
  raise ChatTemplateError(
    f"{origin} is a {type(value).__name__}; it must be a string or a list of named templates."
  )


def load_chat_template(
  folder: str | os.PathLike, tokenizer_config: Mapping[str, Any] | None
) -> tuple[str | None, str]:
  """Returns (template text or None, where it came from) for a Hugging Face tokenizer folder.

  ``chat_template.jinja`` wins over ``tokenizer_config.json["chat_template"]``, as in
  transformers; from a list of named templates the one named "default" is used.
  """
  path = os.path.join(os.fspath(folder), CHAT_TEMPLATE_FILE)
  if os.path.isfile(path):
    origin = f"the chat template {path}"
    try:
      with open(path, encoding="utf-8") as f:
        return f.read(), origin
    except (OSError, UnicodeDecodeError) as e:
      raise ChatTemplateError(f"cannot read the chat template {path}: {e}.") from None
  config_path = os.path.join(os.fspath(folder), TOKENIZER_CONFIG_FILE)
  origin = f"the chat_template in {config_path}"
  value = (tokenizer_config or {}).get("chat_template")
  return select_chat_template(value, origin), origin
