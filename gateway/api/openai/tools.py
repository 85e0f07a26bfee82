"""OpenAI function calling: `tools`, `tool_choice` and `parallel_tool_calls` onto the
canonical Tool and ToolChoice (shapes checked here; the worker checks each schema deeply),
and the calls a turn made back into a message's `tool_calls` and a stream's deltas."""

from __future__ import annotations

from gateway.api.common import check_name, invalid, no_parameters, unsupported
from gateway.api.openai.schemas import (
    FunctionCallOut,
    FunctionDelta,
    ToolCallChunk,
    ToolCallOut,
    ToolChoiceParam,
    ToolParam,
)
from shared.types import Tool, ToolCall, ToolCallDelta, ToolChoice, ToolChoiceMode

_MODES = {mode.value: mode for mode in ToolChoiceMode}


def tools_of(params: list[ToolParam] | None) -> list[Tool]:
    tools: list[Tool] = []
    for i, param in enumerate(params or []):
        where = f"tools[{i}]"
        if param.type != "function":
            raise unsupported(f"{where}.type", f"{param.type!r}: only function tools are served")
        fn = param.function
        if fn is None:
            raise invalid(f"`{where}` is a function tool without `function`", f"{where}.function")
        check_name(fn.name, f"{where}.function.name")
        if any(tool.name == fn.name for tool in tools):
            raise invalid(
                f"`{where}.function.name`: two tools are named {fn.name!r}",
                f"{where}.function.name",
            )
        parameters = no_parameters() if fn.parameters is None else fn.parameters
        tools.append(Tool(fn.name, fn.description or "", parameters, bool(fn.strict)))
    return tools


def tool_choice_of(
    choice: str | ToolChoiceParam | None, parallel: bool | None, tools: list[Tool]
) -> ToolChoice | None:
    """None: no tools, or the default (AUTO, calls in parallel allowed)."""
    name = None
    if choice is None:
        mode = ToolChoiceMode.AUTO
    elif isinstance(choice, str):
        if choice not in _MODES:
            raise invalid(
                f'`tool_choice` must be "none", "auto", "required" or a function, not {choice!r}',
                "tool_choice",
            )
        mode = _MODES[choice]
    elif choice.type != "function":
        raise unsupported(
            "tool_choice",
            f'type {choice.type!r}: use "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
        )
    elif choice.function is None:
        raise invalid("a function `tool_choice` needs `function.name`", "tool_choice")
    else:
        mode, name = ToolChoiceMode.REQUIRED, choice.function.name
    if not tools:
        if mode is ToolChoiceMode.REQUIRED:
            raise invalid("`tool_choice` asks for a call but there are no `tools`", "tool_choice")
        return None
    if name is not None and all(tool.name != name for tool in tools):
        raise invalid(f"`tool_choice` names {name!r}, which is not among `tools`", "tool_choice")
    if choice is None and parallel is not False:
        return None
    return ToolChoice(mode, name, parallel is not False)


def calls_out(calls: list[ToolCall]) -> list[ToolCallOut]:
    """A whole turn's calls, for a message's `tool_calls`."""
    return [ToolCallOut(call.id, FunctionCallOut(call.name, call.arguments)) for call in calls]


def call_chunks(deltas: list[ToolCallDelta]) -> list[ToolCallChunk]:
    """One stream delta's calls: a call's first piece with its id, type and name; pieces of
    one call that arrived together (the reader lagging) as one."""
    chunks: list[ToolCallChunk] = []
    for delta in deltas:
        first = bool(delta.id or delta.name)
        last = chunks[-1] if chunks else None
        if last is not None and last.index == delta.index and not first:
            last.function.arguments = (last.function.arguments or "") + delta.arguments
            continue
        chunk = ToolCallChunk(index=delta.index, function=FunctionDelta(arguments=delta.arguments))
        if first:
            chunk.id, chunk.type, chunk.function.name = delta.id, "function", delta.name
        chunks.append(chunk)
    return chunks
