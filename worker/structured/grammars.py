"""The grammar a request's output must follow, as llguidance grammars: a JSON schema
(response_format), any JSON object (json mode), or the model's own tool-call markup around
arguments that match each tool's schema (a required or named tool choice).

docs/benchmarks.md ("Structured output: choosing the constraint library") says why
llguidance: it works wherever the worker runs (the mask is computed on the host and applied
with plain MLX ops), compiles schemas in well under a millisecond and covers the most of
JSON Schema.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast

import llguidance

from shared.types import OutputFormat, ResponseFormat, Tool, ToolChoice, ToolChoiceMode
from worker.backends.formats import JSON_CALL_FORMATS, XML_CALL_FORMATS, ToolFormat

# Formats whose calls this module can force; others serve tool_choice "auto" and "none".
FORCEABLE = JSON_CALL_FORMATS | XML_CALL_FORMATS | {"mistral"}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# JSON is written as Python's json.dumps writes it ({"a": 1, "b": [2, 3]}): no free
# whitespace between tokens, which a model could otherwise repeat until max_tokens. A
# schema that is not strict may use keywords llguidance does not implement (ignored);
# a strict one must be enforced whole, so those are a 400.
JSON_STYLE: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# A string parameter's value in the XML form and its closing tag, as one lexeme: any text
# without "<" (newlines too), then the tag. (llguidance's lexer does not backtrack: a value
# lexeme of its own would swallow the newline that starts the tag.)
_XML_TEXT_CLOSE = r"/[^<]+\n<\/parameter>\n/"
NL = "\n"


class GrammarError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def response_grammar(fmt: ResponseFormat) -> str | None:
    """response_format -> a grammar (None: plain text)."""
    if fmt.type is OutputFormat.TEXT:
        return None
    if fmt.type is OutputFormat.JSON_OBJECT:
        return json_grammar(ANY_OBJECT, fmt.param, strict=True)
    if not isinstance(fmt.schema, dict):
        raise GrammarError("a json_schema response format needs a `schema` object", fmt.param)
    return json_grammar(fmt.schema, fmt.param, fmt.strict)


def json_grammar(schema: dict[str, Any], param: str, strict: bool) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides=cast(Any, {**JSON_STYLE, "lenient": not strict})
        )
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the JSON schema is not usable: {exc}", param) from None


def _styled(schema: dict[str, Any], strict: bool) -> dict[str, Any]:
    """A schema embedded in a lark grammar, with the JSON style as its x-guidance."""
    return {**schema, "x-guidance": {**JSON_STYLE, "lenient": not strict}}


def tool_grammar(
    tools: list[Tool],
    choice: ToolChoice,
    fmt: ToolFormat | None,
    literal: Callable[[str], str] = json.dumps,
) -> str | None:
    """A required or named tool choice -> the model's call markup, forced (None: the
    model decides, AUTO / NONE). `literal` writes the markers as lark (Grammars.literal:
    a marker that is one added token is that token)."""
    if choice.mode is not ToolChoiceMode.REQUIRED:
        return None
    if fmt is None:
        raise GrammarError("this model has no known tool-call format", "tool_choice")
    chosen = [t for t in tools if choice.name is None or t.name == choice.name]
    repeat = choice.parallel and choice.name is None  # a named choice is one call
    if not chosen:
        raise GrammarError(
            f"tool_choice names {choice.name!r}, which is not in tools", "tool_choice"
        )
    defs = _definitions(chosen)
    if fmt.parser in JSON_CALL_FORMATS:
        body = json.dumps(_styled({**_json_call(chosen), **defs}, _strict(chosen)))
        call = f"{literal(fmt.start)} {_lit(NL)} %json {body} {_lit(NL)} {literal(fmt.end)}"
        return _lark(call, repeat, "\n")
    if fmt.parser in XML_CALL_FORMATS:
        rules = [f"call: {' | '.join(f'call{i}' for i in range(len(chosen)))}"]
        rules += [_xml_call(i, tool, fmt, literal, defs) for i, tool in enumerate(chosen)]
        return _lark("call", repeat, "\n", rules)
    if fmt.parser == "mistral":  # [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
        items: dict[str, Any] = {"type": "array", "items": _json_call(chosen), "minItems": 1}
        items |= defs
        if not repeat:
            items["maxItems"] = 1
        body = json.dumps(_styled(items, _strict(chosen)))
        return _lark(f"{literal(fmt.start)} %json {body}", False, "")
    raise GrammarError(
        f"a required or named tool_choice is not served for this model's tool-call format "
        f"({fmt.parser or 'unnamed'}); its calls cannot be constrained: use tool_choice auto",
        "tool_choice",
    )


def _definitions(tools: list[Tool]) -> dict[str, Any]:
    """The tools' root definitions (`$defs`, `definitions`: what Pydantic's schemas refer to
    with `#/$defs/...`), for the root of the schema that wraps their parameters, where those
    references then point; the same name defined two ways by two tools is a 400."""
    found: dict[str, dict[str, Any]] = {}
    for tool in tools:
        for key in ("$defs", "definitions"):
            defined = (tool.parameters or {}).get(key)
            if not isinstance(defined, dict):
                continue
            have = found.setdefault(key, {})
            for name, sub in defined.items():
                if name in have and have[name] != sub:
                    raise GrammarError(
                        f"the tools' parameters define {key}/{name} in two ways, and a forced "
                        "call's grammar holds them as one schema",
                        "tools",
                    )
                have[name] = sub
    return found


def _strict(tools: list[Tool]) -> bool:
    return all(t.strict for t in tools)


def _json_call(tools: list[Tool]) -> dict[str, Any]:
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.name},
                "arguments": t.parameters or ANY_OBJECT,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _xml_call(
    index: int,
    tool: Tool,
    fmt: ToolFormat,
    literal: Callable[[str], str],
    defs: dict[str, Any] | None = None,
) -> str:
    """One tool's call in Qwen3-Coder's XML: each parameter in the schema's order,
    required ones always, optional ones optionally; strings raw, the rest as JSON (each
    its own schema, with the tools' root definitions beside it)."""
    schema = tool.parameters or {}
    properties = schema.get("properties") or {}
    required = schema.get("required") or []
    if not isinstance(properties, dict) or not isinstance(required, list):
        raise GrammarError(
            f"tool {tool.name!r}: `properties` must be an object and `required` a list", "tools"
        )
    parts = [literal(fmt.start), _lit(f"\n<function={tool.name}>\n")]
    for key, sub in properties.items():
        value = _xml_value({**sub, **(defs or {})} if isinstance(sub, dict) else {}, tool.strict)
        param = f"({_lit(f'<parameter={key}>' + NL)} {value})"
        parts.append(param if key in set(required) else param + "?")
    parts += [_lit("</function>\n"), literal(fmt.end)]
    return f"call{index}: " + " ".join(parts)


def _xml_value(schema: dict[str, Any], strict: bool) -> str:
    """A parameter's value and its closing tag."""
    kind = schema.get("type")
    closing = _lit("\n</parameter>\n")
    if kind == "string" and "enum" in schema:
        return "(" + " | ".join(_lit(str(v)) for v in schema["enum"]) + f") {closing}"
    if kind == "string" and isinstance(schema.get("maxLength"), int):
        low, high = max(1, schema.get("minLength") or 1), max(1, schema["maxLength"])
        return f"/[^<\\n]{{{low},{high}}}\\n<\\/parameter>\\n/"
    if kind == "string":
        return _XML_TEXT_CLOSE
    return f"%json {json.dumps(_styled(schema, strict))} {closing}"


def _lark(call: str, repeat: bool, separator: str, rules: list[str] | None = None) -> str:
    start = f"start: {call}" if not repeat else f"start: {call} ({_lit(separator)}? {call})*"
    if rules:
        start = "start: call" if not repeat else f"start: call ({_lit(separator)}? call)*"
    text = "\n".join([start, *(rules or [])]) + "\n"
    return llguidance.grammar_from("lark", text)


def _lit(text: str) -> str:
    """A lark string literal."""
    return json.dumps(text)
