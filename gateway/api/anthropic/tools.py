"""Anthropic's `tools` and `tool_choice` as the canonical Tool and ToolChoice. Pure.

Client tools only: the model calls them and the client runs them. Server tools (a `type`
such as "web_search_20250305" or "bash_20250124") run on Anthropic's side and are refused.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.api.anthropic.schemas import (
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceParam,
    ToolDef,
)
from gateway.api.common import check_name, invalid
from gateway.errors import validation_error
from shared.types import Tool, ToolChoice, ToolChoiceMode


def _tool(raw: dict[str, Any], where: str) -> ToolDef:
    kind = raw.get("type")
    if kind is not None and kind != "custom":
        raise invalid(
            f"`{where}.type` is {kind!r}: server tools are not served (or left out, with "
            'server.hosted_tools = "omit"); a client tool has `name`, `description` and '
            "`input_schema` (and no `type`, or 'custom')",
            f"{where}.type",
        )
    try:
        tool = msgspec.convert(raw, ToolDef)
    except msgspec.ValidationError as exc:
        raise validation_error(exc, where) from exc
    check_name(tool.name, f"{where}.name")
    if tool.input_schema.get("type") != "object":
        raise invalid(
            f"`{where}.input_schema.type` must be 'object': the input is a JSON object",
            f"{where}.input_schema.type",
        )
    return tool


def tools_of(raw: list[dict[str, Any]] | None, omit_hosted: bool = False) -> list[Tool]:
    """The request's tools, each checked; a 400 names the first bad one's field. Server
    tools are refused, or left out with `omit_hosted` (server.hosted_tools = "omit")."""
    tools: list[Tool] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(raw or []):
        where = f"tools[{i}]"
        kind = entry.get("type") if isinstance(entry, dict) else None
        if omit_hosted and isinstance(kind, str) and kind != "custom":
            continue
        tool = _tool(entry, where)
        if tool.name in seen:
            raise invalid(
                f"`{where}.name`: the tool {tool.name!r} is tools[{seen[tool.name]}] already; "
                "tool names must be unique",
                f"{where}.name",
            )
        seen[tool.name] = i
        tools.append(Tool(tool.name, tool.description, tool.input_schema, tool.strict))
    return tools


def tool_choice_of(choice: ToolChoiceParam | None, tools: list[Tool]) -> ToolChoice | None:
    """None when nothing was asked (or there are no tools to choose from); `any` and
    `tool` need tools, and `tool` one of them by name."""
    if choice is None or (not tools and isinstance(choice, ToolChoiceAuto | ToolChoiceNone)):
        return None
    if not tools:
        kind = type(choice).__struct_config__.tag
        raise invalid(f"`tool_choice` of type {kind!r} needs `tools`", "tool_choice")
    if isinstance(choice, ToolChoiceNone):
        return ToolChoice(ToolChoiceMode.NONE)
    parallel = not choice.disable_parallel_tool_use
    if isinstance(choice, ToolChoiceAuto):
        return ToolChoice(ToolChoiceMode.AUTO, parallel=parallel)
    if isinstance(choice, ToolChoiceAny):
        return ToolChoice(ToolChoiceMode.REQUIRED, parallel=parallel)
    if choice.name not in {tool.name for tool in tools}:
        raise invalid(
            f"`tool_choice.name` is {choice.name!r}, which is not the name of one of `tools`",
            "tool_choice.name",
        )
    return ToolChoice(ToolChoiceMode.REQUIRED, choice.name, parallel)
