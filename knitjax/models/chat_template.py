"""Chat templates: find a model's Jinja template and render it the way `transformers` does.

`transformers`' ``apply_chat_template`` renders the template in an immutable Jinja sandbox with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` tag,
a ``tojson`` filter that does not escape HTML, and the globals ``raise_exception``,
``strftime_now``, ``dict`` and ``namespace`` (``transformers/utils/chat_template_utils.py``).
This module mirrors that environment with jinja2 alone, so a prompt rendered here is the prompt the
model was trained on, byte for byte, without importing `transformers`.

A template comes with a model folder, so it is untrusted input: it renders in the bounded sandbox
of `knitjax.models.jinja_budget` (steps, time, sizes). Whatever a template does
(`{{ 1/0 }}`, a macro that calls itself, `{{ 'x' * 10**12 }}`, loops nested 10**10 deep), the
render ends with one sentence naming the template, a `ChatTemplateError`.
"""

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np

from knitjax.models import jinja_budget

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# The names a message's reasoning travels under; transformers fills all of them from any one.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


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


@functools.lru_cache(maxsize=16)
def _compile(template: str, origin: str) -> jinja2.Template:
  env = jinja_budget.BoundedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  jinja_budget.bound_filters(env)
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
  except (RecursionError, SyntaxError, MemoryError) as e:  # Python's limits on the code it makes
    raise ChatTemplateError(
      f"{origin} does not compile: it nests blocks or expressions too deeply for Python "
      f"({type(e).__name__}: {_end_sentence(getattr(e, 'msg', None) or str(e))[:-1]}); "
      "flatten its loops, conditions or parentheses."
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
    try:
      return jinja_budget.render(
        self._template,
        messages=chat,
        tools=_plain(tools),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **kwargs,
      )
    except jinja_budget.TooBig as e:
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
