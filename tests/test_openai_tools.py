"""OpenAI function calling, structured output and reasoning: tools, tool_choice,
parallel_tool_calls, response_format and reasoning_effort onto the canonical request (every
400 names its field), and tool calls and reasoning back out, whole and as stream deltas, in
shapes the official `openai` SDK parses."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types import Completion as SdkCompletion
from openai.types.chat import ChatCompletion as SdkChatCompletion
from openai.types.chat import ChatCompletionChunk as SdkChunk
from openai.types.chat import ChatCompletionMessageFunctionToolCall as FunctionToolCall

from gateway.api.openai.translate import ChatFormatter, CompletionFormatter
from gateway.api.relay import Choice
from gateway.errors import GatewayError
from shared.types import (
    FinishReason,
    Message,
    OutputFormat,
    Reasoning,
    RequestOutput,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
    Usage,
)
from tests.openai_bodies import chat, completion, completions, one, rejected, sse

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}


def named(error: GatewayError, param: str) -> None:
    """The 400 names the field, in `param` and in its message (at least the top field)."""
    assert error.param == param
    assert param.split(".")[0].split("[")[0] in error.message, error.message


def fn(name: str = "weather", **more: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **more}}


# ---- tools -------------------------------------------------------------------------------


def test_tools_map_onto_the_canonical_tools() -> None:
    request, _ = chat(
        tools=[
            fn(description="Weather in a city.", parameters=WEATHER, strict=True),
            fn("get-time_2"),
        ]
    )
    assert request.tools == [
        Tool("weather", "Weather in a city.", WEATHER, strict=True),
        Tool("get-time_2", "", {"type": "object", "properties": {}}),  # no parameters: none
    ]
    assert request.tool_choice is None  # AUTO, calls in parallel allowed
    assert request.needs() == ["tools"]
    assert chat(tools=[fn(parameters=None)])[0].tools[0].parameters == {
        "type": "object",
        "properties": {},
    }


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([{"type": "custom", "custom": {"name": "grep"}}], "tools[0].type"),
        ([fn(), {"type": "web_search"}], "tools[1].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([fn("")], "tools[0].function.name"),
        ([{"type": "function", "function": {}}], "tools[0].function.name"),
        ([fn("has space")], "tools[0].function.name"),
        ([fn("a.b")], "tools[0].function.name"),
        ([fn("x" * 65)], "tools[0].function.name"),
        ([fn(), fn("other"), fn()], "tools[2].function.name"),
        ([fn(parameters=[1, 2])], "tools[0].function.parameters"),
        ([fn(parameters="{}")], "tools[0].function.parameters"),
        ([fn(strict="yes")], "tools[0].function.strict"),
        ([fn(returns={})], "tools[0].function.returns"),
        ([{**fn(), "cache_control": {}}], "tools[0].cache_control"),
    ],
)
def test_bad_tools_are_named(tools: list[Any], param: str) -> None:
    named(rejected(chat, tools=tools), param)


def test_a_duplicate_tool_name_says_so() -> None:
    assert "two tools" in rejected(chat, tools=[fn(), fn()]).message


def test_a_64_character_name_is_allowed() -> None:
    assert chat(tools=[fn("x" * 64)])[0].tools[0].name == "x" * 64


# ---- tool_choice and parallel_tool_calls ---------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "choice"),
    [
        ({}, None),
        ({"parallel_tool_calls": True}, None),
        ({"parallel_tool_calls": False}, ToolChoice(ToolChoiceMode.AUTO, parallel=False)),
        ({"tool_choice": "auto"}, ToolChoice(ToolChoiceMode.AUTO)),
        ({"tool_choice": "none"}, ToolChoice(ToolChoiceMode.NONE)),
        ({"tool_choice": "required"}, ToolChoice(ToolChoiceMode.REQUIRED)),
        (
            {"tool_choice": "required", "parallel_tool_calls": False},
            ToolChoice(ToolChoiceMode.REQUIRED, parallel=False),
        ),
        (
            {"tool_choice": {"type": "function", "function": {"name": "weather"}}},
            ToolChoice(ToolChoiceMode.REQUIRED, "weather"),
        ),
    ],
)
def test_tool_choice_maps(fields: dict[str, Any], choice: ToolChoice | None) -> None:
    assert chat(tools=[fn(), fn("time")], **fields)[0].tool_choice == choice


def test_tool_choice_none_needs_no_tools_capability() -> None:
    request, _ = chat(tools=[fn()], tool_choice="none")
    assert request.tools and request.needs() == []  # the tools still go into the prompt


def test_no_tools_means_no_choice() -> None:
    for fields in (
        {"tool_choice": "none"},
        {"tool_choice": "auto"},
        {"tools": [], "tool_choice": "auto", "parallel_tool_calls": False},
        {"parallel_tool_calls": False},
    ):
        request, _ = chat(**fields)
        assert (request.tools, request.tool_choice) == ([], None)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"tools": [fn()], "tool_choice": "any"}, "tool_choice"),
        ({"tools": [fn()], "tool_choice": 1}, "tool_choice"),
        (
            {"tools": [fn()], "tool_choice": {"type": "function", "function": {"name": "time"}}},
            "tool_choice",
        ),
        ({"tools": [fn()], "tool_choice": {"type": "function"}}, "tool_choice"),
        (
            {"tools": [fn()], "tool_choice": {"type": "function", "function": {}}},
            "tool_choice.function",
        ),
        (
            {
                "tools": [fn()],
                "tool_choice": {
                    "type": "allowed_tools",
                    "allowed_tools": {"mode": "auto", "tools": [fn()]},
                },
            },
            "tool_choice",
        ),
        ({"tools": [fn()], "tool_choice": {"type": "custom", "custom": {}}}, "tool_choice"),
        ({"tools": [fn()], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"tools": [fn()], "tool_choice": {"type": "function", "name": "f"}}, "tool_choice.name"),
    ],
)
def test_bad_tool_choices_are_named(fields: dict[str, Any], param: str) -> None:
    named(rejected(chat, **fields), param)


def test_legacy_function_fields_stay_refused() -> None:
    for fields in ({"functions": [{"name": "f"}]}, {"function_call": {"name": "f"}}):
        error = rejected(chat, **fields)
        assert error.param == next(iter(fields)) and "use `tool" in error.message


def test_tool_calls_and_results_in_the_history_are_served() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "hm"},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    request, _ = chat(messages=messages, tools=[fn()])
    assert request.messages[1:] == [
        Message("assistant", "", tool_calls=[ToolCall("call_1", "weather", "{}")], reasoning="hm"),
        Message("tool", "sunny", tool_call_id="call_1"),
    ]


# ---- response_format -----------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "count", "schema": SCHEMA}}


def test_response_format_maps() -> None:
    assert chat(response_format={"type": "text"})[0].response_format is None
    request, _ = chat(response_format={"type": "json_object"})
    assert request.response_format == ResponseFormat(OutputFormat.JSON_OBJECT)
    assert request.response_format.param == "response_format"
    assert request.needs() == ["structured_output"]
    request, _ = chat(response_format=JSON_SCHEMA)
    assert request.response_format == ResponseFormat(
        OutputFormat.JSON_SCHEMA, SCHEMA, "count", param="response_format.json_schema.schema"
    )
    spec = {"name": "c", "schema": SCHEMA, "strict": True, "description": "a count"}
    request, _ = chat(response_format={"type": "json_schema", "json_schema": spec})
    assert request.response_format is not None and request.response_format.strict is True


BAD_FORMATS = [
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "c"}}, "response_format.json_schema.schema"),
    (
        {"type": "json_schema", "json_schema": {"name": "c", "schema": [1]}},
        "response_format.json_schema.schema",
    ),
    (
        {"type": "json_schema", "json_schema": {"name": "c", "schema": "{}"}},
        "response_format.json_schema.schema",
    ),
    (
        {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}},
        "response_format.json_schema.name",
    ),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema"),
    (
        {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "extra": 1}},
        "response_format.json_schema.extra",
    ),
    ({"type": "json_object", "json_schema": {"name": "c"}}, "response_format.json_schema"),
    ({"type": "grammar"}, "response_format.type"),
    ({"type": "json_object", "schema": SCHEMA}, "response_format.schema"),
    ({}, "response_format"),
    ("json", "response_format"),
]


@pytest.mark.parametrize(("fmt", "param"), BAD_FORMATS)
def test_bad_response_formats_are_named(fmt: Any, param: str) -> None:
    named(rejected(chat, response_format=fmt), param)
    named(rejected(completion, response_format=fmt), param)


def test_completions_take_a_response_format_for_every_prompt() -> None:
    assert completion(response_format={"type": "text"})[0].response_format is None
    request, _ = completion(response_format={"type": "json_object"})
    assert request.response_format == ResponseFormat(OutputFormat.JSON_OBJECT)
    jobs = completions(prompt=["a", [1, 2]], response_format=JSON_SCHEMA)
    assert [r.response_format.type for r, _ in jobs if r.response_format] == [
        OutputFormat.JSON_SCHEMA,
        OutputFormat.JSON_SCHEMA,
    ]
    for field in ("tools", "tool_choice", "reasoning_effort"):
        assert rejected(completion, **{field: "auto"}).param == field  # not completions fields


# ---- reasoning_effort ---------------------------------------------------------------------


@pytest.mark.parametrize("effort", ["minimal", "low", "medium", "high"])
def test_reasoning_effort_maps(effort: str) -> None:
    request, _ = chat(reasoning_effort=effort)
    assert request.reasoning == Reasoning(effort=effort)
    assert request.needs() == ["reasoning"]


def test_reasoning_effort_none_turns_thinking_off() -> None:
    request, _ = chat(reasoning_effort="none")
    assert request.reasoning == Reasoning(enabled=False) and request.needs() == []
    assert chat()[0].reasoning is None


@pytest.mark.parametrize("effort", ["max", "xhigh", "High", "", 1])
def test_bad_reasoning_effort_is_named(effort: Any) -> None:
    named(rejected(chat, reasoning_effort=effort), "reasoning_effort")


# ---- responses: streaming -----------------------------------------------------------------


def out(text: str = "", **fields: Any) -> RequestOutput:
    return RequestOutput("r", text=text, **fields)


def first_call(index: int, name: str, arguments: str = "") -> ToolCallDelta:
    return ToolCallDelta(index, f"call_{index}", name, arguments)


def test_a_reasoning_delta_is_a_chunk_of_its_own() -> None:
    fmt = ChatFormatter("m")
    chunk = one(fmt.stream_delta(0, out(reasoning="Let me think.", token_ids=[1])))
    assert chunk["choices"][0]["delta"] == {"reasoning_content": "Let me think."}
    both = one(fmt.stream_delta(0, out("Hi", reasoning=" Done.", token_ids=[2, 3])))
    assert both["choices"][0]["delta"] == {"content": "Hi", "reasoning_content": " Done."}
    plain = fmt.stream_delta(0, out("Hi", token_ids=[2]))
    assert b'"delta":{"content":"Hi"},' in plain  # no new keys without the new features
    assert fmt.stream_delta(0, out(token_ids=[4])) == b""


def test_tool_call_deltas_stream_in_openai_shapes() -> None:
    fmt = ChatFormatter("m")
    head = one(fmt.stream_delta(0, out(tool_calls=[first_call(0, "weather")])))
    assert head["choices"][0]["delta"] == {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_0",
                "type": "function",
                "function": {"name": "weather", "arguments": ""},
            }
        ]
    }
    more = one(fmt.stream_delta(0, out(tool_calls=[ToolCallDelta(0, arguments='{"city"')])))
    assert more["choices"][0]["delta"] == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]
    }
    finish = one(fmt.stream_finish(0, out(finish_reason=FinishReason.TOOL_CALLS)))
    assert finish["choices"][0] == {
        "index": 0,
        "delta": {},
        "finish_reason": "tool_calls",
        "logprobs": None,
    }


def test_merged_deltas_keep_one_entry_per_call_piece() -> None:
    """The reader lagging merges deltas: pieces of one call join, a new call starts anew."""
    deltas = [
        ToolCallDelta(0, arguments=': "Oslo"'),
        ToolCallDelta(0, arguments="}"),
        first_call(1, "time", "{"),
        ToolCallDelta(1, arguments="}"),
    ]
    chunk = one(ChatFormatter("m").stream_delta(0, out("", tool_calls=deltas)))
    assert chunk["choices"][0]["delta"] == {
        "tool_calls": [
            {"index": 0, "function": {"arguments": ': "Oslo"}'}},
            {
                "index": 1,
                "id": "call_1",
                "type": "function",
                "function": {"name": "time", "arguments": "{}"},
            },
        ]
    }


TURN = [
    out(reasoning="Need the weather.", token_ids=[1]),
    out("Checking.", token_ids=[2]),
    out(tool_calls=[first_call(0, "weather", '{"ci')], token_ids=[3]),
    out(tool_calls=[ToolCallDelta(0, arguments='ty": "Oslo"}')], token_ids=[4]),
    out(tool_calls=[first_call(1, "time"), ToolCallDelta(1, arguments="{}")], token_ids=[5]),
    out(finish_reason=FinishReason.TOOL_CALLS, usage=Usage(5, 5)),
]


def test_the_sdk_accumulates_a_streamed_turn() -> None:
    fmt = ChatFormatter("m", include_usage=True)
    body = fmt.stream_start(TURN[0])
    for output in TURN:
        body += fmt.stream_delta(0, output)
        if output.finish_reason is not None:
            body += fmt.stream_finish(0, output)
    body += fmt.stream_end(Usage(5, 5))
    *events, done = sse(body)
    assert done == "[DONE]"
    chunks = [SdkChunk.model_validate_json(json.dumps(event)) for event in events]
    content, reasoning, finish = "", "", None
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content", "")
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                assert call.function is not None
                entry["id"] += call.id or ""
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    assert (content, reasoning, finish) == ("Checking.", "Need the weather.", "tool_calls")
    assert calls == {
        0: {"id": "call_0", "name": "weather", "arguments": '{"city": "Oslo"}'},
        1: {"id": "call_1", "name": "time", "arguments": "{}"},
    }
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 10


# ---- responses: whole -----------------------------------------------------------------------


def collected(outputs: list[RequestOutput], index: int = 0) -> Choice:
    choice = Choice(index)
    for output in outputs:
        choice.add(output)
    return choice


def test_a_turn_of_calls_is_a_message_with_tool_calls() -> None:
    body = ChatFormatter("m").response([collected(TURN[2:])], Usage(5, 3))
    message = json.loads(body)["choices"][0]["message"]
    assert message == {
        "content": None,
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_0",
                "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                "type": "function",
            },
            {"id": "call_1", "function": {"name": "time", "arguments": "{}"}, "type": "function"},
        ],
    }
    assert json.loads(body)["choices"][0]["finish_reason"] == "tool_calls"


def test_the_sdk_parses_a_whole_turn() -> None:
    body = ChatFormatter("m", n=2).response(
        [collected(TURN), collected([out("Hi", finish_reason=FinishReason.STOP)], 1)],
        Usage(5, 6),
    )
    parsed = SdkChatCompletion.model_validate_json(body)
    turn, plain = parsed.choices
    assert turn.finish_reason == "tool_calls"
    assert turn.message.content == "Checking."  # text before the calls stays
    assert (turn.message.model_extra or {})["reasoning_content"] == "Need the weather."
    calls = turn.message.tool_calls or []
    assert all(isinstance(c, FunctionToolCall) for c in calls)
    assert [(c.id, c.type) for c in calls] == [("call_0", "function"), ("call_1", "function")]
    assert [
        (c.function.name, c.function.arguments) for c in calls if isinstance(c, FunctionToolCall)
    ] == [
        ("weather", '{"city": "Oslo"}'),
        ("time", "{}"),
    ]
    assert plain.message.content == "Hi" and plain.message.tool_calls is None
    assert plain.finish_reason == "stop"


def test_a_plain_answer_keeps_its_bytes() -> None:
    body = ChatFormatter("m").response(
        [collected([out("Hi", finish_reason=FinishReason.STOP)])], Usage()
    )
    assert b'"message":{"content":"Hi","role":"assistant"},' in body
    empty = ChatFormatter("m").response(
        [collected([out(finish_reason=FinishReason.STOP)])], Usage()
    )
    assert b'"message":{"content":"","role":"assistant"},' in empty  # no calls: not null


def test_reasoning_without_an_answer_keeps_content_a_string() -> None:
    choice = collected([out(reasoning="hmm", finish_reason=FinishReason.LENGTH)])
    message = json.loads(ChatFormatter("m").response([choice], Usage()))["choices"][0]["message"]
    assert message == {"content": "", "role": "assistant", "reasoning_content": "hmm"}


def test_the_sdk_parses_a_structured_completion() -> None:
    fmt = CompletionFormatter("m", ["Count:"])
    choice = collected([out('{"n": 3}', finish_reason=FinishReason.STOP)])
    parsed = SdkCompletion.model_validate_json(fmt.response([choice], Usage(2, 4)))
    assert json.loads(parsed.choices[0].text) == {"n": 3}
