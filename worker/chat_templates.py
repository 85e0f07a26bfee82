"""Chat templates (Jinja, ChatML turns) for the generated tiny models, and the tokens each uses.

`CHAT_TEMPLATE` is the plain template every generated model had first. The others are built
from pieces: a tool-call format ("hermes": JSON calls as in Hermes and Qwen2.5/Qwen3;
"qwen3_coder": XML calls as in Qwen3-Coder) and thinking (`<think>` blocks as in Qwen3). mlx-lm
recognises each by its markers when it loads the tokenizer, and parses the calls back with its
own `json_tools` and `qwen3_coder` parsers.

The templates have no newlines of their own between tags (every newline is a string literal),
so transformers' trim_blocks and lstrip_blocks leave them as written.
"""

from __future__ import annotations

TOOL_FORMATS = ("hermes", "qwen3_coder")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
THINK_TOKENS = ("<think>", "</think>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    # As Qwen3-style templates: a thinking switch, off (and invisible) unless passed.
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)

# A message's text: a string, the text parts of a list of parts, or nothing (None).
_TEXT_MACRO = (
    "{% macro text(content) %}"
    "{% if content is string %}{{ content }}"
    "{% elif content is iterable and content is not mapping %}"
    "{% for part in content %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{% endmacro %}"
)

# Reasoning in the history is shown only for turns after the last user message, as Qwen3 does.
_LAST_USER = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
)

_HERMES_TOOLS = (
    "{{ '# Tools\\n\\nYou may call one or more functions to answer the user.\\n\\n"
    "Each function is described by a JSON object, one per line, inside <tools></tools>:"
    "\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nTo call a function, answer with a JSON object of its name and "
    "arguments inside <tool_call></tool_call>, one block per call:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>\' }}'
)

# `tool_call` is the call's function (OpenAI's {"function": {...}} or the bare {name, arguments}).
_HERMES_CALL = (
    "{{ '<tool_call>\\n{\"name\": ' + (tool_call.name | tojson) + ', \"arguments\": ' }}"
    "{% if tool_call.arguments is string %}{{ tool_call.arguments }}"
    "{% elif tool_call.arguments is defined %}{{ tool_call.arguments | tojson }}"
    "{% else %}{{ '{}' }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
)

_CODER_TOOLS = (
    "{{ '# Tools\\n\\nYou may call these functions:\\n\\n<tools>' }}"
    "{% for tool in tools %}"
    "{% set fn = tool.function if tool.function is defined else tool %}"
    "{{ '\\n<function>\\n<name>' + fn.name + '</name>' }}"
    "{% if fn.description %}{{ '\\n<description>' + fn.description + '</description>' }}"
    "{% endif %}"
    "{{ '\\n<parameters>' }}"
    "{% if fn.parameters is mapping and fn.parameters.properties is mapping %}"
    "{% for name, param in fn.parameters.properties | items %}"
    "{{ '\\n<parameter>\\n<name>' + name + '</name>' }}"
    "{% if param.type is defined %}"
    "{{ '\\n<type>' + (param.type if param.type is string else param.type | tojson) + '</type>' }}"
    "{% endif %}"
    "{% if param.description %}"
    "{{ '\\n<description>' + param.description + '</description>' }}"
    "{% endif %}"
    "{% if param.enum is defined %}{{ '\\n<enum>' + (param.enum | tojson) + '</enum>' }}"
    "{% endif %}"
    "{{ '\\n</parameter>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '\\n</parameters>' }}"
    "{% if fn.parameters is mapping and fn.parameters.required %}"
    "{{ '\\n<required>' + (fn.parameters.required | tojson) + '</required>' }}"
    "{% endif %}"
    "{{ '\\n</function>' }}"
    "{% endfor %}"
    "{{ '\\n</tools>\\n\\nTo call a function, answer in this form, one block per call:\\n"
    "<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n"
    "</tool_call>\\n\\nA string VALUE is written as it is; any other value as JSON.' }}"
)

# Arguments must be a mapping here: Jinja cannot parse a JSON string into parameters (callers
# decode OpenAI's argument strings first, as mlx-lm's server does).
_CODER_CALL = (
    "{{ '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{% if tool_call.arguments is mapping %}"
    "{% for key, value in tool_call.arguments | items %}"
    "{{ '<parameter=' + key + '>\\n' }}"
    "{% if value is string %}{{ value }}{% else %}{{ value | tojson }}{% endif %}"
    "{{ '\\n</parameter>\\n' }}"
    "{% endfor %}"
    "{% elif tool_call.arguments is defined and tool_call.arguments is not none %}"
    "{{ raise_exception('tool call arguments must be an object (a mapping), not a string') }}"
    "{% endif %}"
    "{{ '</function>\\n</tool_call>' }}"
)

_TOOL_RESPONSE = (
    # Consecutive tool results share one user turn, as in Qwen's templates.
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
)

_FORMATS = {"hermes": (_HERMES_TOOLS, _HERMES_CALL), "qwen3_coder": (_CODER_TOOLS, _CODER_CALL)}

_THINK_PROMPT = (
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}"
)


def chat_template(tool_format: str | None = None, thinking: bool = False) -> str:
    """The template for a model with this tool-call format (None: no tools) and thinking;
    with neither, the plain CHAT_TEMPLATE."""
    if tool_format is None and not thinking:
        return CHAT_TEMPLATE
    if tool_format is not None and tool_format not in _FORMATS:
        raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, not {tool_format!r}")
    return "".join(
        [
            _TEXT_MACRO,
            _LAST_USER if thinking else "",
            _system_with_tools(tool_format),
            "{% for message in messages %}",
            "{% set role = message['role'] %}",
            "{% if loop.first and role == 'system' and tools %}",  # rendered with the tools
            "{% elif role == 'assistant' %}",
            _assistant(tool_format, thinking),
            ("{% elif role == 'tool' %}" + _TOOL_RESPONSE) if tool_format else "",
            "{% else %}",
            "{{ '<|im_start|>' + role + '\\n' + text(message['content']) + '<|im_end|>\\n' }}",
            "{% endif %}",
            "{% endfor %}",
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}",
            _THINK_PROMPT if thinking else "",
            "{% endif %}",
        ]
    )


def format_tokens(tool_format: str | None, thinking: bool) -> list[str]:
    """The tokens a template of this kind uses beyond ChatML's (added to the vocab as text,
    not special, so that they decode as text as in Qwen's tokenizers)."""
    return [*(TOOL_TOKENS if tool_format else ()), *(THINK_TOKENS if thinking else ())]


def _system_with_tools(tool_format: str | None) -> str:
    """With tools, a system turn first: the system message's text (if any), then the tools."""
    if tool_format is None:
        return ""
    return (
        "{% if tools %}{{ '<|im_start|>system\\n' }}"
        "{% if messages and messages[0]['role'] == 'system' %}"
        "{{ text(messages[0]['content']) + '\\n\\n' }}"
        "{% endif %}" + _FORMATS[tool_format][0] + "{{ '<|im_end|>\\n' }}{% endif %}"
    )


def _assistant(tool_format: str | None, thinking: bool) -> str:
    """An assistant turn: its reasoning (thinking models, after the last user message), its
    text, then its tool calls, a newline between blocks."""
    head = "{{ '<|im_start|>assistant\\n' }}{% set content = text(message['content']) %}"
    if thinking:
        head += (
            "{% set reasoning = message['reasoning_content'] %}"
            "{% if reasoning is string and reasoning and loop.index0 > ns.last_user %}"
            "{{ '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}"
            "{% set content = content.lstrip('\\n') %}"
            "{% endif %}"
        )
    head += "{{ content }}"
    calls = ""
    if tool_format is not None:
        calls = (
            "{% for call in message['tool_calls'] or [] %}"
            "{% set tool_call = call.function if call.function is defined else call %}"
            "{% if content or not loop.first %}{{ '\\n' }}{% endif %}"
            + _FORMATS[tool_format][1]
            + "{% endfor %}"
        )
    return head + calls + "{{ '<|im_end|>\\n' }}"
