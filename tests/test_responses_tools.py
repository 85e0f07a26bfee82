"""The Responses API's tools, structured output and reasoning on the way in, without worker
processes: the request's mapping onto the canonical request (and each 400, naming its
field), the settings echoed, and function calls and reasoning in the input."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.api.common import Unserved, no_parameters
from gateway.api.relay import Choice
from gateway.api.responses.formatter import ResponsesFormatter
from gateway.api.responses.translate import canonical_of, check_request, input_items, new_response
from gateway.errors import GatewayError
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    FinishReason,
    ImagePart,
    Message,
    OutputFormat,
    Reasoning,
    RequestOutput,
    ResponseFormat,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    Usage,
)
from tests.responses_helpers import WEATHER, _parse, _request, _response


def _canonical(**fields: Any) -> CanonicalRequest:
    body = _request(**fields)
    options = check_request(body)
    assert body.input is not None
    return canonical_of(body, [], input_items(body.input), options)


# ---- the request ---------------------------------------------------------------------------


def test_tools_and_choices_map() -> None:
    bare = {"type": "function", "name": "now"}
    request = _canonical(tools=[WEATHER, bare])
    assert request.tools == [
        Tool("get_weather", "The weather in a city.", WEATHER["parameters"]),
        Tool("now", "", no_parameters()),
    ]
    assert request.tool_choice is None and request.needs() == ["tools"]
    cases: list[tuple[Any, bool | None, ToolChoice | None]] = [
        ("auto", None, ToolChoice(ToolChoiceMode.AUTO)),
        ("none", None, ToolChoice(ToolChoiceMode.NONE)),
        ("required", False, ToolChoice(ToolChoiceMode.REQUIRED, parallel=False)),
        ({"type": "function", "name": "now"}, None, ToolChoice(ToolChoiceMode.REQUIRED, "now")),
        (None, False, ToolChoice(ToolChoiceMode.AUTO, parallel=False)),
    ]
    for choice, parallel, expected in cases:
        fields: dict[str, Any] = {"tools": [WEATHER, bare], "tool_choice": choice}
        if parallel is not None:
            fields["parallel_tool_calls"] = parallel
        assert _canonical(**fields).tool_choice == expected, choice
    strict = _canonical(tools=[{**bare, "strict": True}]).tools[0]
    assert strict.strict is True
    # Nothing to choose from: "auto" and "none" ask for nothing.
    assert _canonical(tool_choice="none").tool_choice is None
    assert _canonical(tools=[WEATHER], tool_choice="none").needs() == []


def test_formats_and_reasoning_map() -> None:
    assert _canonical(text={"format": {"type": "text"}}).response_format is None
    fmt = _canonical(text={"format": {"type": "json_object"}}).response_format
    assert fmt == ResponseFormat(OutputFormat.JSON_OBJECT, param="text.format")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = _canonical(
        text={"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}}
    )
    assert request.response_format == ResponseFormat(
        OutputFormat.JSON_SCHEMA, schema, "A", True, param="text.format.schema"
    )
    assert request.needs() == ["structured_output"]
    for effort in ("minimal", "low", "medium", "high"):
        assert _canonical(reasoning={"effort": effort}).reasoning == Reasoning(effort=effort)
    assert _canonical(reasoning={"effort": "none"}).reasoning == Reasoning(enabled=False)
    assert _canonical(reasoning={"effort": "none"}).needs() == []
    # A summary alone asks for nothing (the reasoning text comes back, not summarized).
    assert _canonical(reasoning={"summary": "auto"}).reasoning is None
    assert _canonical(reasoning={"effort": "low", "summary": "detailed"}).needs() == ["reasoning"]


def test_settings_echo() -> None:
    schema_format = {"type": "json_schema", "name": "A", "schema": {"type": "object"}}
    body = _request(
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": schema_format},
        reasoning={"effort": "low", "summary": "auto"},
    )
    response = new_response(body, options=check_request(body))
    echoed = _response(ResponsesFormatter(response).encode(response))
    assert echoed.tools[0].type == "function" and echoed.tools[0].name == "get_weather"
    assert echoed.tools[0].strict is False
    assert echoed.tool_choice.type == "function"  # type: ignore[union-attr]
    assert echoed.text is not None and echoed.text.format is not None
    assert echoed.text.format.type == "json_schema"
    assert echoed.reasoning is not None
    assert (echoed.reasoning.effort, echoed.reasoning.summary) == ("low", "auto")


TOOL_TYPES = [
    "web_search",
    "web_search_preview",
    "file_search",
    "computer_use_preview",
    "mcp",
    "code_interpreter",
    "image_generation",
    "custom",
    "local_shell",
]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        *(({"tools": [{"type": kind}]}, "tools[0].type") for kind in TOOL_TYPES),
        ({"tools": [WEATHER, {"name": "f"}]}, "tools[1].type"),
        ({"tools": ["f"]}, "tools[0]"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{**WEATHER, "name": "get weather"}]}, "tools[0].name"),
        ({"tools": [{**WEATHER, "name": "x" * 65}]}, "tools[0].name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
        ({"tools": [{**WEATHER, "parameters": []}]}, "tools[0].parameters"),
        ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_object", "schema": {}}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
        (
            {"text": {"format": {"type": "json_schema", "name": "a", "schema": 1}}},
            "text.format.schema",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}},
            "text.format.name",
        ),
        ({"reasoning": {"effort": "xhigh"}}, "reasoning.effort"),
        ({"reasoning": {"summary": "long"}}, "reasoning.summary"),
        ({"reasoning": {"context": "all_turns"}}, "reasoning.context"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0]"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]},
            "input[0].call_id",
        ),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {
                        "type": "function_call_output",
                        "call_id": "c1",
                        "output": [{"type": "input_file"}],
                    },
                ]
            },
            "input[1].output[0].type",
        ),
        (
            {"input": [{"type": "reasoning", "summary": [{"type": "x", "text": "t"}]}]},
            "input[0].summary[0].type",
        ),
    ],
)
def test_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(GatewayError) as exc:
        _canonical(**fields)
    assert exc.value.code == ErrorCode.INVALID_REQUEST and exc.value.status == 400
    assert exc.value.param == param, exc.value.message


def test_input_calls_results_and_reasoning_become_messages() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a":1}'}
    request = _canonical(
        input=[
            {"role": "user", "content": "go"},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "hm"}],
            },
            {"role": "assistant", "content": "Calling."},
            call,
            {**call, "call_id": "c2", "id": "fc_2"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "2"}],
            },
            # OpenAI's own reasoning item: its summary stands for the reasoning.
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "so"}],
            },
            {**call, "call_id": "c3"},
            {"type": "function_call_output", "call_id": "c3", "output": "3"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "dropped"}]},
            {"role": "user", "content": "and?"},
        ]
    )
    assert request.messages == [
        Message("user", "go"),
        Message(
            "assistant",
            "Calling.",
            tool_calls=[ToolCall("c1", "f", '{"a":1}'), ToolCall("c2", "f", '{"a":1}')],
            reasoning="hm",
        ),
        Message("tool", "1", tool_call_id="c1"),
        Message("tool", "2", tool_call_id="c2"),
        Message("assistant", tool_calls=[ToolCall("c3", "f", '{"a":1}')], reasoning="so"),
        Message("tool", "3", tool_call_id="c3"),
        Message("user", "and?"),
    ]


def test_sealed_reasoning_goes_back_and_forth() -> None:
    # include reasoning.encrypted_content (Codex asks it whenever it sets reasoning, with
    # store false): the reasoning item carries its text sealed, and a request that passes
    # only that back (no content, as such clients do) has its thinking again
    fmt = ResponsesFormatter(new_response(_request()), sealed=True)
    choice = Choice(0, pieces=["Done."], thoughts=["I think ✓"])
    choice.finish_reason = FinishReason.STOP
    body = json.loads(fmt.response([choice], Usage(5, 3)))
    reasoning = body["output"][0]
    assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"].startswith("mlxgw")
    plain = json.loads(ResponsesFormatter(new_response(_request())).response([choice], Usage(5, 3)))
    streamed = ResponsesFormatter(new_response(_request()), sealed=True)
    first = RequestOutput("r", reasoning="I think ✓", token_ids=[1], usage=Usage(5, 0))
    last = RequestOutput("r", text="Done.", token_ids=[2], finish_reason=FinishReason.STOP)
    raw = streamed.stream_start(first) + streamed.stream_delta(0, first)
    raw += streamed.stream_delta(0, last) + streamed.stream_finish(0, last)
    [done, *_] = [d for n, d in _parse(raw) if n == "response.output_item.done"]
    assert done["item"]["encrypted_content"] == reasoning["encrypted_content"]
    assert "encrypted_content" not in plain["output"][0]  # not asked: not there
    passed = {"type": "reasoning", "id": reasoning["id"], "summary": []}
    passed["encrypted_content"] = reasoning["encrypted_content"]
    request = _canonical(
        include=["reasoning.encrypted_content"],
        input=[
            {"role": "user", "content": "go"},
            passed,
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
        ],
    )
    assert request.messages[1] == Message(
        "assistant", tool_calls=[ToolCall("c1", "f", "{}")], reasoning="I think ✓"
    )
    # OpenAI's own sealed text is not readable here: its summary stands for it, as before
    foreign = {**passed, "encrypted_content": "gAAAA-openai", "summary": [_summary("s")]}
    assert _canonical(input=[foreign, {"role": "user", "content": "x"}]).messages[0].role == "user"
    broken = {**passed, "encrypted_content": "mlxgw1:%%%"}
    with pytest.raises(GatewayError) as info:
        _canonical(input=[{"role": "user", "content": "go"}, broken])
    assert info.value.param == "input[1].encrypted_content"


def _summary(text: str) -> dict[str, str]:
    return {"type": "summary_text", "text": text}


def test_hosted_tools_are_refused_or_left_out_as_the_server_says() -> None:
    # Codex declares its web_search (and may a freeform apply_patch) with every turn
    tools = [
        WEATHER,
        {"type": "web_search", "external_web_access": False},
        {"type": "custom", "name": "apply_patch", "format": {"type": "text"}},
    ]
    error = _refusal_of(lambda: check_request(_request(tools=tools)))
    assert error.param == "tools[1].type" and 'server.hosted_tools = "omit"' in error.message
    options = check_request(_request(tools=tools), omit_hosted=True)
    assert [tool.name for tool in options.tools] == [WEATHER["name"]]
    echoed = new_response(_request(tools=tools), options=options).tools
    assert [tool["name"] for tool in echoed] == [WEATHER["name"]]  # what was served
    assert _refusal_of(lambda: check_request(_request(tools=["x"]), True)).param == "tools[0]"


def test_a_function_output_may_hold_images() -> None:
    # a tool's screenshot (Codex's view_image): the tool message carries the image, for a
    # vision model (a text model's request is refused, as for any image: `unserved`)
    png = "data:image/png;base64,iVBORw0KGgo="
    output = [
        {"type": "input_text", "text": "the screen:"},
        {"type": "input_image", "image_url": png, "detail": "original"},
    ]
    call = {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"}
    result = {"type": "function_call_output", "call_id": "c1", "output": output}
    body = _request(input=[{"role": "user", "content": "look"}, call, result])
    unserved = Unserved()
    items = input_items(body.input, unserved)  # type: ignore[arg-type]
    assert "image" in unserved.features
    bad = {**result, "output": [{"type": "input_file", "file_id": "f"}]}
    refused = _refusal_of(lambda: _canonical(input=[call, bad]))
    assert refused.param == "input[1].output[0].type" and "input_image" in refused.message
    tool = canonical_of(body, [], items, check_request(body)).messages[-1]
    assert tool.role == "tool" and tool.content == "the screen:" and tool.tool_call_id == "c1"
    [text, image] = tool.parts
    assert isinstance(text, TextPart) and isinstance(image, ImagePart)
    assert image.where == "input[2].output[1].image_url" and image.detail == "high"  # original
    text_only = {**result, "output": [{"type": "input_text", "text": "a"}, output[0]]}
    assert _canonical(input=[call, text_only]).messages[-1].content == "athe screen:"


def _refusal_of(call: Any) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        call()
    return info.value
