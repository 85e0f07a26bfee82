"""The grammar a request's output must follow, as llguidance grammars: a JSON schema
(response_format), any JSON object (json mode), or the model's own tool-call markup around
arguments that match each tool's schema (a required or named tool choice; under auto, after
any text where a tool is strict, or in place of a response format's JSON).

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
    answer: ResponseFormat | None = None,
    best_effort: bool = False,
) -> str | None:
    """The grammar of an output that may or must call `tools` (None: nothing to hold).

    A required or named choice: the model's call markup, forced. Under auto, the model
    decides, and a grammar is made only where something must hold all the same: a strict
    tool's arguments (any text, then calls whose arguments match the tools' schemas) or a
    response format (`answer`: the answer is that JSON, or the output is calls). `literal`
    writes the markers as lark (Grammars.literal: a marker that is one added token is that
    token). `best_effort` (engine.strict_tools): strict tools under auto on a format that
    cannot be constrained are served unconstrained instead of refused."""
    if choice.mode is ToolChoiceMode.NONE:
        return None
    forced = choice.mode is ToolChoiceMode.REQUIRED
    strict = any(t.strict for t in tools)
    if not forced and answer is None and not strict:
        return None  # auto: the calls are parsed as the model writes them
    param = "tool_choice" if forced else "tools" if strict or answer is None else answer.param
    if fmt is None:
        raise GrammarError("this model has no known tool-call format", param)
    if fmt.parser not in FORCEABLE:
        if best_effort and not forced and answer is None:
            return None  # the operator's choice: calls parsed as written, unchecked
        if forced:
            what, hint = "a required or named tool_choice", "use tool_choice auto"
        elif strict:
            what = "a strict tool's arguments"
            hint = "send strict false (or set engine.strict_tools = 'best_effort')"
        else:
            what = "a response format beside tools the model may call"
            hint = "constrain the answer (tool_choice none) or leave the format out"
        raise GrammarError(
            f"{what} cannot be constrained in this model's tool-call format "
            f"({fmt.parser or 'unnamed'}): {hint}",
            param,
        )
    chosen = [t for t in tools if choice.name is None or t.name == choice.name]
    if not chosen:
        raise GrammarError(
            f"tool_choice names {choice.name!r}, which is not in tools", "tool_choice"
        )
    repeat = choice.parallel and choice.name is None  # a named choice is one call
    rules = _call_rules(chosen, fmt, literal, repeat)
    calls = "call" if not repeat or not fmt.end else f"call ({_lit(NL)}? call)*"
    if forced:
        return _lark(f"start: {calls}", rules)
    if answer is not None:  # that JSON, or calls
        if answer.type is OutputFormat.JSON_OBJECT:
            schema, exact = ANY_OBJECT, True
        elif isinstance(answer.schema, dict):
            schema, exact = answer.schema, answer.strict
        else:
            raise GrammarError(
                "a json_schema response format needs a `schema` object", answer.param
            )
        rules.append(f"answer: %json {json.dumps(_styled(schema, exact))}")
        return _lark(f"start: answer | {calls}", rules)
    marker = literal(fmt.start)
    if marker.startswith("<["):  # an added token: text never writes it
        return _lark(f"start: TEXT? ({calls})?", [*rules, r"TEXT: /(.|\n)+/"])
    # a marker of plain text: text that does not hold it, or text up to it and the calls
    text = fmt.start
    more = f"({_lit(NL)}? call)*" if repeat and fmt.end else ""
    rules += [
        f"lead[suffix={_lit(text)}]: " + r"/(.|\n)*/",
        r"TEXT: /(.|\n)*/ & ~/(.|\n)*" + _regex_text(text) + r"(.|\n)*/",
    ]
    return _lark(f"start: TEXT | lead body {more}", rules)


def _call_rules(
    tools: list[Tool], fmt: ToolFormat, literal: Callable[[str], str], repeat: bool
) -> list[str]:
    """Lark rules of one call: `call`, its marker and `body`, the rest (what a call must be
    once its marker is written). `repeat`: more than one call may follow (in mistral's
    list form they are items of one list)."""
    defs = _definitions(tools)
    rules = [f"call: {literal(fmt.start)} body"]
    if fmt.parser in JSON_CALL_FORMATS:
        body = json.dumps(_styled({**_json_call(tools), **defs}, _strict(tools)))
        return [*rules, f"body: {_lit(NL)} %json {body} {_lit(NL)} {literal(fmt.end)}"]
    if fmt.parser in XML_CALL_FORMATS:
        rules.append(f"body: {' | '.join(f'body{i}' for i in range(len(tools)))}")
        return rules + [_xml_call(i, t, fmt, literal, defs) for i, t in enumerate(tools)]
    # mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], every call in one list,
    # or (its v11 templates) [TOOL_CALLS]NAME[ARGS]{...}, the marker again before each next
    strict = _strict(tools)
    items: dict[str, Any] = {"type": "array", "items": _json_call(tools), "minItems": 1}
    if not repeat:
        items["maxItems"] = 1
    args = literal("[ARGS]")
    headed = [
        f"{_lit(t.name)} {args} %json {json.dumps(_styled(_arguments(t) | defs, strict))}"
        for t in tools
    ]
    more = f"({literal(fmt.start)}? header)*" if repeat else ""
    return [
        *rules,
        f"body: %json {json.dumps(_styled(items | defs, strict))} | header {more}",
        f"header: {' | '.join(headed)}",
    ]


def _arguments(tool: Tool) -> dict[str, Any]:
    return tool.parameters or ANY_OBJECT


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
                        f"the tools' parameters define {key}/{name} in two ways, and the "
                        "calls' grammar holds them as one schema",
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
                "arguments": _arguments(t),
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
    """One tool's call in Qwen3-Coder's XML after its marker: each parameter in the schema's order,
    required ones always, optional ones optionally; strings raw, the rest as JSON (each
    its own schema, with the tools' root definitions beside it)."""
    schema = tool.parameters or {}
    properties = schema.get("properties") or {}
    required = schema.get("required") or []
    if not isinstance(properties, dict) or not isinstance(required, list):
        raise GrammarError(
            f"tool {tool.name!r}: `properties` must be an object and `required` a list", "tools"
        )
    parts = [_lit(f"\n<function={tool.name}>\n")]
    for key, sub in properties.items():
        value = _xml_value({**sub, **(defs or {})} if isinstance(sub, dict) else {}, tool.strict)
        param = f"({_lit(f'<parameter={key}>' + NL)} {value})"
        parts.append(param if key in set(required) else param + "?")
    parts += [_lit("</function>\n"), literal(fmt.end)]
    return f"body{index}: " + " ".join(parts)


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


def _lark(start: str, rules: list[str]) -> str:
    return llguidance.grammar_from("lark", "\n".join([start, *rules]) + "\n")


# the characters a regex of llguidance (Rust's regex syntax) reads as more than themselves
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~/")


def _regex_text(text: str) -> str:
    """`text` as a regex that matches it alone."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _lit(text: str) -> str:
    """A lark string literal."""
    return json.dumps(text)
