"""A Responses request's generation options as the canonical request's: `tools`,
`tool_choice` and `parallel_tool_calls`, `text.format`, `reasoning`. Pure; each refusal is a
400 naming the field (`tools[i].type`, `tool_choice`, `text.format.schema`, ...).

A function tool's `strict` defaults to false, as on chat completions (the Responses API's
own default is true).
`reasoning.summary` is accepted, but nothing summarizes: the reasoning item carries the
model's own reasoning text (`content`), with an empty `summary`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from gateway.api.common import check_name, invalid, no_parameters, unsupported
from gateway.api.responses.schemas import (
    FunctionToolIn,
    JsonSchemaFormatIn,
    ReasoningConfig,
    ResponsesRequest,
)
from gateway.errors import validation_error
from shared.types import (
    OutputFormat,
    Reasoning,
    ResponseFormat,
    Tool,
    ToolChoice,
    ToolChoiceMode,
)

T = TypeVar("T")


@dataclass(slots=True)
class Options:
    tools: list[Tool]
    tool_choice: ToolChoice | None
    response_format: ResponseFormat | None
    reasoning: Reasoning | None


def options_of(body: ResponsesRequest, omit_hosted: bool = False) -> Options:
    tools = tools_of(body.tools or [], omit_hosted)
    return Options(
        tools,
        tool_choice_of(body.tool_choice, tools, body.parallel_tool_calls),
        format_of(body.text.format if body.text is not None else None),
        reasoning_of(body.reasoning),
    )


def convert(value: Any, type_: type[T], where: str) -> T:
    """msgspec.convert, with a failure as a 400 naming the path below `where`."""
    try:
        return msgspec.convert(value, type_)
    except msgspec.ValidationError as exc:
        raise validation_error(exc, where) from None


# ---- tools -------------------------------------------------------------------------------


def tools_of(raw: list[Any], omit_hosted: bool = False) -> list[Tool]:
    """The function tools; a tool of another kind is a 400 naming it, or left out with
    `omit_hosted` (server.hosted_tools = "omit")."""
    tools: list[Tool] = []
    for i, entry in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(entry, dict):
            raise invalid(f"`{where}` must be an object", where)
        kind = entry.get("type")
        if kind != "function" and omit_hosted and isinstance(kind, str):
            continue
        if kind != "function":
            raise invalid(
                f"`{where}.type` {kind!r} is not supported: only function tools are served "
                "(OpenAI's hosted tools, custom and MCP tools are not; the gateway can leave "
                'them out instead: server.hosted_tools = "omit"; Codex: web_search = '
                '"disabled" in its config)',
                f"{where}.type",
            )
        tool = convert(entry, FunctionToolIn, where)
        check_name(tool.name, f"{where}.name")
        if any(known.name == tool.name for known in tools):
            raise invalid(
                f"`{where}.name`: a tool named {tool.name!r} is listed twice", f"{where}.name"
            )
        parameters = no_parameters() if tool.parameters is None else tool.parameters
        tools.append(Tool(tool.name, tool.description or "", parameters, bool(tool.strict)))
    return tools


_MODES = {
    "auto": ToolChoiceMode.AUTO,
    "none": ToolChoiceMode.NONE,
    "required": ToolChoiceMode.REQUIRED,
}


def tool_choice_of(raw: Any, tools: list[Tool], parallel: bool | None) -> ToolChoice | None:
    """None when there is nothing to choose from, or when the defaults are asked for."""
    if raw is None:
        mode, name = ToolChoiceMode.AUTO, None
    elif isinstance(raw, str) and raw in _MODES:
        mode, name = _MODES[raw], None
    elif isinstance(raw, dict) and raw.get("type") == "function":
        mode, name = ToolChoiceMode.REQUIRED, raw.get("name")
        if not isinstance(name, str) or set(raw) != {"type", "name"}:
            raise invalid('`tool_choice` must be {"type": "function", "name": ...}', "tool_choice")
        if not any(tool.name == name for tool in tools):
            raise invalid(f"`tool_choice` names {name!r}, which is not in `tools`", "tool_choice")
    else:
        raise unsupported(
            "tool_choice",
            'only "auto", "none", "required" or {"type": "function", "name": ...} are served',
        )
    if not tools:
        if mode is ToolChoiceMode.REQUIRED:
            raise invalid("`tool_choice` requires a tool call, but `tools` is empty", "tool_choice")
        return None
    if raw is None and parallel is None:
        return None
    return ToolChoice(mode, name, True if parallel is None else parallel)


def tools_echo(tools: list[Tool]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "name": tool.name,
            "description": tool.description or None,
            "parameters": tool.parameters,
            "strict": tool.strict,
        }
        for tool in tools
    ]


# ---- text.format and reasoning -------------------------------------------------------------


def format_of(raw: dict[str, Any] | None) -> ResponseFormat | None:
    """None for plain text (nothing to constrain)."""
    kind = None if raw is None else raw.get("type")
    if raw is None or (kind == "text" and set(raw) == {"type"}):
        return None
    if kind == "json_object" and set(raw) == {"type"}:
        return ResponseFormat(OutputFormat.JSON_OBJECT, param="text.format")
    if kind == "json_schema":
        fmt = convert(raw, JsonSchemaFormatIn, "text.format")
        check_name(fmt.name, "text.format.name")
        return ResponseFormat(
            OutputFormat.JSON_SCHEMA,
            fmt.schema,
            fmt.name,
            bool(fmt.strict),
            param="text.format.schema",
        )
    if kind in ("text", "json_object"):
        extra = sorted(set(raw) - {"type"})[0]
        raise unsupported(f"text.format.{extra}", f"a {kind} format has no other field")
    raise invalid(
        f"`text.format.type` {kind!r} is not supported: one of text, json_object, json_schema",
        "text.format.type",
    )


def reasoning_of(config: ReasoningConfig | None) -> Reasoning | None:
    """An effort level; "none" turns thinking off. A summary alone asks for nothing."""
    if config is None or config.effort is None:
        return None
    if config.effort == "none":
        return Reasoning(enabled=False)
    return Reasoning(effort=config.effort)


def reasoning_echo(config: ReasoningConfig | None) -> dict[str, Any] | None:
    if config is None:
        return None
    summary = config.summary or config.generate_summary
    if config.effort is None and summary is None:
        return None
    return {"effort": config.effort, "summary": summary}
