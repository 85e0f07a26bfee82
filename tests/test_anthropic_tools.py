"""Anthropic tool use and extended thinking: `tools`, `tool_choice` and `thinking` onto the
canonical request (and their 400s, each naming its field); thinking, text and tool_use blocks
in the response body and in the stream; the official SDK reads both. Pure: no processes."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2  # the SDK's HTTP client
import pytest
from anthropic.types import Message as SdkMessage
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from gateway.api.anthropic.formatter import MessagesFormatter, tool_input
from gateway.api.anthropic.schemas import CountTokensRequest, MessagesRequest
from gateway.api.anthropic.translate import messages_formatter, messages_request, prompt_request
from gateway.api.common import decode_body
from gateway.api.relay import Choice
from gateway.errors import GatewayError
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    FinishReason,
    Message,
    Reasoning,
    RequestOutput,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
    Usage,
)

USER = [{"role": "user", "content": "Weather in Oslo?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "weather", "description": "Current weather", "input_schema": SCHEMA}
CLOCK = {"name": "clock", "input_schema": {"type": "object"}}


def body(**fields: Any) -> MessagesRequest:
    raw = {"model": "m", "max_tokens": 64, "messages": USER, **fields}
    return decode_body(json.dumps(raw).encode(), MessagesRequest)


def create(**fields: Any) -> CanonicalRequest:
    return messages_request(body(**fields))[0]


def refused(**fields: Any) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        create(**fields)
    assert info.value.code == ErrorCode.INVALID_REQUEST and info.value.status == 400
    return info.value


# ---- tools and tool_choice ---------------------------------------------------------------


def test_tools_map() -> None:
    custom = {**CLOCK, "type": "custom", "strict": True, "cache_control": {"type": "ephemeral"}}
    canonical = create(tools=[WEATHER, custom])
    assert canonical.tools == [
        Tool("weather", "Current weather", SCHEMA),
        Tool("clock", "", {"type": "object"}, strict=True),
    ]
    assert canonical.tool_choice is None  # AUTO, parallel calls allowed
    assert canonical.needs() == ["tools"]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, ToolChoice(ToolChoiceMode.AUTO)),
        (
            {"type": "auto", "disable_parallel_tool_use": True},
            ToolChoice(ToolChoiceMode.AUTO, parallel=False),
        ),
        ({"type": "any"}, ToolChoice(ToolChoiceMode.REQUIRED)),
        (
            {"type": "any", "disable_parallel_tool_use": True},
            ToolChoice(ToolChoiceMode.REQUIRED, parallel=False),
        ),
        ({"type": "tool", "name": "clock"}, ToolChoice(ToolChoiceMode.REQUIRED, "clock")),
        (
            {"type": "tool", "name": "clock", "disable_parallel_tool_use": True},
            ToolChoice(ToolChoiceMode.REQUIRED, "clock", parallel=False),
        ),
        ({"type": "none"}, ToolChoice(ToolChoiceMode.NONE)),
    ],
)
def test_tool_choice_maps(choice: dict[str, Any], expected: ToolChoice) -> None:
    canonical = create(tools=[WEATHER, CLOCK], tool_choice=choice)
    assert canonical.tool_choice == expected
    # tool_choice none: the tools still go into the prompt, but no call is asked for
    assert canonical.needs() == ([] if choice["type"] == "none" else ["tools"])


def test_auto_or_none_without_tools_is_no_choice() -> None:
    assert create(tool_choice={"type": "auto"}) == create()
    assert create(tools=[], tool_choice={"type": "none"}) == create()


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type", ""),
        ({"tools": [WEATHER, {"type": "bash_20250124", "name": "bash"}]}, "tools[1].type", ""),
        ({"tools": [{"type": "text_editor_20250124", "name": "e"}]}, "tools[0].type", ""),
        ({"tools": [{**CLOCK, "name": "has space"}]}, "tools[0].name", "letters, digits"),
        ({"tools": [{**CLOCK, "name": ""}]}, "tools[0].name", ""),
        ({"tools": [{**CLOCK, "name": "x" * 65}]}, "tools[0].name", ""),
        ({"tools": [CLOCK, WEATHER, CLOCK]}, "tools[2].name", "tools[0]"),
        (
            {"tools": [{"name": "f", "input_schema": {"type": "array"}}]},
            "tools[0].input_schema.type",
            "",
        ),
        ({"tools": [{"name": "f", "input_schema": {}}]}, "tools[0].input_schema.type", "'object'"),
        ({"tools": [{"name": "f", "input_schema": "object"}]}, "tools[0].input_schema", ""),
        ({"tools": [{"name": "f"}]}, "tools[0]", "input_schema"),
        ({"tools": [{**CLOCK, "defer_loading": True}]}, "tools[0].defer_loading", ""),
        ({"tools": ["clock"]}, "tools[0]", ""),
        ({"tool_choice": {"type": "any"}}, "tool_choice", "needs `tools`"),
        ({"tool_choice": {"type": "tool", "name": "clock"}}, "tool_choice", "needs `tools`"),
        ({"tools": [CLOCK], "tool_choice": {"type": "tool", "name": "f"}}, "tool_choice.name", ""),
        ({"tools": [CLOCK], "tool_choice": {"type": "tool"}}, "tool_choice", "name"),
        ({"tools": [CLOCK], "tool_choice": {"type": "required"}}, "tool_choice.type", ""),
        ({"tools": [CLOCK], "tool_choice": "auto"}, "tool_choice", ""),
        (
            {"tools": [CLOCK], "tool_choice": {"type": "none", "disable_parallel_tool_use": True}},
            "tool_choice.disable_parallel_tool_use",
            "",
        ),
    ],
)
def test_tool_refusals_name_the_field(fields: dict[str, Any], param: str, says: str) -> None:
    error = refused(**fields)
    assert error.param == param, error.message
    assert param in error.message and says in error.message


def test_server_tools_are_refused_as_such() -> None:
    error = refused(tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert "server tools are not served" in error.message and "web_search_20250305" in error.message


# ---- thinking ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("thinking", "expected"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, Reasoning(enabled=True, budget_tokens=1024)),
        ({"type": "enabled", "budget_tokens": 8}, Reasoning(enabled=True, budget_tokens=8)),
        (
            {"type": "enabled", "budget_tokens": 16, "display": "summarized"},
            Reasoning(enabled=True, budget_tokens=16),
        ),
        ({"type": "adaptive"}, Reasoning(advisory=True)),
        ({"type": "disabled"}, Reasoning(enabled=False)),
    ],
)
def test_thinking_maps(thinking: dict[str, Any], expected: Reasoning) -> None:
    canonical = create(thinking=thinking, max_tokens=2048)
    assert canonical.reasoning == expected
    assert canonical.needs() == ([] if not expected.required else ["reasoning"])


def test_no_thinking_leaves_it_to_the_template() -> None:
    assert create().reasoning is None


@pytest.mark.parametrize(
    ("thinking", "param", "says"),
    [
        ({"type": "enabled", "budget_tokens": 64}, "thinking.budget_tokens", "less than"),
        ({"type": "enabled", "budget_tokens": 100}, "thinking.budget_tokens", "`max_tokens` (64)"),
        ({"type": "enabled", "budget_tokens": 0}, "thinking.budget_tokens", ""),
        ({"type": "enabled"}, "thinking", "budget_tokens"),
        ({"type": "between_tools"}, "thinking.type", ""),
        ({"type": "adaptive", "display": "full"}, "thinking.display", ""),
        ({"type": "disabled", "budget_tokens": 1}, "thinking.budget_tokens", ""),
    ],
)
def test_thinking_refusals_name_the_field(thinking: dict[str, Any], param: str, says: str) -> None:
    error = refused(thinking=thinking)
    assert error.param == param, error.message
    assert param in error.message and says in error.message


def test_count_tokens_carries_tools_and_thinking() -> None:
    thinking = {"type": "enabled", "budget_tokens": 4096}  # no max_tokens to be under here
    raw = {"model": "m", "messages": USER, "tools": [WEATHER], "thinking": thinking}
    raw["tool_choice"] = {"type": "any"}
    counted = prompt_request(decode_body(json.dumps(raw).encode(), CountTokensRequest))
    assert counted.tools == [Tool("weather", "Current weather", SCHEMA)]
    assert counted.tool_choice == ToolChoice(ToolChoiceMode.REQUIRED)
    assert counted.reasoning == Reasoning(enabled=True, budget_tokens=4096)


def test_a_tool_use_round_trip_is_served() -> None:
    """The history of a call: thinking and the call in the assistant turn, its result."""
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": ""},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "12C"}],
        },
    ]
    canonical = create(messages=messages, tools=[WEATHER])
    assert canonical.messages[1:] == [
        Message(
            "assistant",
            tool_calls=[ToolCall("toolu_1", "weather", '{"city": "Oslo"}')],
            reasoning="Look it up.",
        ),
        Message("tool", "12C", tool_call_id="toolu_1"),
    ]
    assert canonical.add_generation_prompt


# ---- the formatter a request gets --------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "text_first", "shown"),
    [
        ({}, True, True),
        ({"tools": []}, True, True),
        ({"tools": [CLOCK], "tool_choice": {"type": "none"}}, True, True),
        ({"thinking": {"type": "disabled"}}, True, True),
        ({"tools": [CLOCK]}, False, True),
        ({"thinking": {"type": "adaptive"}}, True, True),  # the model decides: it does not
        ({"thinking": {"type": "enabled", "budget_tokens": 9, "display": "omitted"}}, False, False),
    ],
)
def test_messages_formatter_for_the_request(
    fields: dict[str, Any], text_first: bool, shown: bool
) -> None:
    req = body(**fields)
    fmt = messages_formatter(req, messages_request(req)[0])
    assert (fmt.model, fmt.text_first, fmt.show_thinking) == ("m", text_first, shown)


# ---- responses ---------------------------------------------------------------------------

THINKING_TEXT_CALLS = [
    RequestOutput("r", "", [1], reasoning="Need ", usage=Usage(30, 1, 10)),
    RequestOutput("r", "", [2], reasoning="the weather."),
    RequestOutput("r", "Checking.", [3]),
    RequestOutput("r", "", [4], tool_calls=[ToolCallDelta(0, "toolu_a", "weather")]),
    RequestOutput("r", "", [5], tool_calls=[ToolCallDelta(0, arguments='{"city": ')]),
    RequestOutput(
        "r",
        "",
        [6],
        tool_calls=[
            ToolCallDelta(0, arguments='"Oslo"}'),
            ToolCallDelta(1, "toolu_b", "clock", "{}"),
        ],
    ),
    RequestOutput("r", "", [7], FinishReason.TOOL_CALLS, Usage(30, 7, 10)),
]


def collected(outputs: list[RequestOutput]) -> Choice:
    choice = Choice(0)
    for output in outputs:
        choice.add(output)
    return choice


def streamed(fmt: MessagesFormatter, outputs: list[RequestOutput]) -> bytes:
    """What the relay sends for these deltas of one choice."""
    out = fmt.stream_start(outputs[0])
    for output in outputs:
        out += fmt.stream_delta(0, output)
        if output.finish_reason is not None:
            out += fmt.stream_finish(0, output)
    return out + fmt.stream_end(outputs[-1].usage or Usage())


def events_of(data: bytes) -> list[dict[str, Any]]:
    """Each event's data, checked against its name and the SDK's event types."""
    events = []
    adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
    for block in data.decode().removesuffix("\n\n").split("\n\n"):
        name_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {event['type']}"
        if event["type"] != "ping":
            adapter.validate_python(event)
        events.append(event)
    return events


def sdk_client(reply: bytes, content_type: str) -> anthropic.Anthropic:
    """The SDK over a transport that answers every request with `reply`."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=reply, headers={"content-type": content_type})

    http = anthropic.DefaultHttpxClient(transport=httpx2.MockTransport(handler))
    return anthropic.Anthropic(api_key="k", base_url="http://gw", http_client=http, max_retries=0)


def sdk_final_message(data: bytes) -> SdkMessage:
    """The message the SDK's own stream accumulation makes of these events."""
    client = sdk_client(data, "text/event-stream")
    with client.messages.stream(model="m", max_tokens=64, messages=USER) as stream:
        return stream.get_final_message()


def test_response_body_has_thinking_text_and_tool_use_blocks() -> None:
    fmt = MessagesFormatter("m", text_first=False)
    raw = fmt.response([collected(THINKING_TEXT_CALLS)], Usage(30, 7, 10))
    body = json.loads(raw)
    assert body["content"] == [
        {"type": "thinking", "thinking": "Need the weather.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_a", "name": "weather", "input": {"city": "Oslo"}},
        {"type": "tool_use", "id": "toolu_b", "name": "clock", "input": {}},
    ]
    assert (body["stop_reason"], body["stop_sequence"]) == ("tool_use", None)
    message = SdkMessage.model_validate_json(raw)
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert message.content[2].input == {"city": "Oslo"}
    # ... and so does the SDK's client, end to end
    created = sdk_client(raw, "application/json").messages.create(
        model="m", max_tokens=64, messages=USER
    )
    assert created == message


def test_an_empty_text_block_is_left_out_only_beside_calls() -> None:
    fmt = MessagesFormatter("m")
    calls = [ToolCall("toolu_a", "clock", "{}")]
    only_calls = Choice(0, finish_reason=FinishReason.TOOL_CALLS, tool_calls=calls)
    body = json.loads(fmt.response([only_calls], Usage(3, 2)))
    assert body["content"] == [{"type": "tool_use", "id": "toolu_a", "name": "clock", "input": {}}]
    nothing = Choice(0, finish_reason=FinishReason.STOP)
    assert json.loads(fmt.response([nothing], Usage(3, 0)))["content"] == [
        {"type": "text", "text": ""}
    ]


def test_arguments_cut_short_are_an_empty_input() -> None:
    calls = [ToolCall("toolu_a", "weather", '{"city": "Os')]
    cut = Choice(0, finish_reason=FinishReason.LENGTH, tool_calls=calls)
    raw = MessagesFormatter("m").response([cut], Usage(3, 8))
    body = json.loads(raw)
    assert body["content"][0]["input"] == {}
    assert body["stop_reason"] == "max_tokens"
    SdkMessage.model_validate_json(raw)
    assert tool_input("[1, 2]") == {} and tool_input("") == {}
    assert tool_input('{"a": [1]}') == {"a": [1]}


def test_omitted_thinking_keeps_its_block_without_text() -> None:
    fmt = MessagesFormatter("m", text_first=False, show_thinking=False)
    choice = collected(THINKING_TEXT_CALLS)
    assert json.loads(fmt.response([choice], Usage()))["content"][0] == {
        "type": "thinking",
        "thinking": "",
        "signature": "",
    }
    events = events_of(streamed(MessagesFormatter("m", False, False), THINKING_TEXT_CALLS))
    thinking = [e for e in events if e.get("index") == 0]
    assert [e["type"] for e in thinking] == [
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
    ]
    assert thinking[1]["delta"] == {"type": "signature_delta", "signature": ""}


def test_stream_of_thinking_text_and_tool_use_blocks() -> None:
    fmt = MessagesFormatter("m", text_first=False)
    events = events_of(streamed(fmt, THINKING_TEXT_CALLS))
    shape = [(e["type"], e.get("index")) for e in events]
    assert shape == [
        ("message_start", None),
        ("ping", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),  # the signature
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("content_block_start", 3),
        ("content_block_delta", 3),
        ("content_block_stop", 3),
        ("message_delta", None),
        ("message_stop", None),
    ]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert starts == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "toolu_a", "name": "weather", "input": {}},
        {"type": "tool_use", "id": "toolu_b", "name": "clock", "input": {}},
    ]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert deltas == [
        {"type": "thinking_delta", "thinking": "Need "},
        {"type": "thinking_delta", "thinking": "the weather."},
        {"type": "signature_delta", "signature": ""},
        {"type": "text_delta", "text": "Checking."},
        {"type": "input_json_delta", "partial_json": '{"city": '},
        {"type": "input_json_delta", "partial_json": '"Oslo"}'},
        {"type": "input_json_delta", "partial_json": "{}"},
    ]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_the_sdk_accumulates_the_stream_into_the_body() -> None:
    """The SDK's stream accumulation makes of the events what the body says."""
    message = sdk_final_message(streamed(MessagesFormatter("m", False), THINKING_TEXT_CALLS))
    body = MessagesFormatter("m", False).response(
        [collected(THINKING_TEXT_CALLS)], Usage(30, 7, 10)
    )
    expected = SdkMessage.model_validate_json(body)
    assert [b.to_dict() for b in message.content] == [b.to_dict() for b in expected.content]
    assert message.content[2].input == {"city": "Oslo"}
    assert (message.stop_reason, message.usage.output_tokens) == ("tool_use", 7)


def test_merged_deltas_keep_the_block_order() -> None:
    """A reader that lags gets one delta holding thinking, text and a call: still in order."""
    merged = RequestOutput(
        "r",
        "Sure.",
        [1, 2, 3],
        reasoning="ok",
        tool_calls=[ToolCallDelta(0, "toolu_a", "clock", "{}")],
        usage=Usage(5, 3),
    )
    done = RequestOutput("r", "", [], FinishReason.TOOL_CALLS, Usage(5, 3))
    message = sdk_final_message(streamed(MessagesFormatter("m", False), [merged, done]))
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]


def test_a_lazy_stream_with_no_pieces_gets_an_empty_text_block() -> None:
    done = RequestOutput("r", "", [], FinishReason.STOP, Usage(5, 0))
    events = events_of(streamed(MessagesFormatter("m", text_first=False), [done]))
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert (
        sdk_final_message(streamed(MessagesFormatter("m", False), [done])).content[0].type == "text"
    )


def test_thinking_after_an_eager_text_block_opens_a_block_of_its_own() -> None:
    """A plain request to a model that thinks by default: the text block opened at the start
    stays empty and closes; thinking and the answer follow, each in its own block."""
    outputs = [
        RequestOutput("r", "", [1], reasoning="hm", usage=Usage(5, 1)),
        RequestOutput("r", "Hi", [2], FinishReason.STOP, Usage(5, 2)),
    ]
    events = events_of(streamed(MessagesFormatter("m"), outputs))
    starts = [(e["index"], e["content_block"]["type"]) for e in events if "content_block" in e]
    assert starts == [(0, "text"), (1, "thinking"), (2, "text")]
    assert events[1]["type"] == "content_block_start" and events[2]["type"] == "ping"
    message = sdk_final_message(streamed(MessagesFormatter("m"), outputs))
    assert [(b.type, getattr(b, "text", None)) for b in message.content] == [
        ("text", ""),
        ("thinking", None),
        ("text", "Hi"),
    ]
