"""Review: bugs in how tool calls, reasoning and text are split and formatted (xfail strict)."""

from __future__ import annotations

import json
from typing import Any

from gateway.api.anthropic.translate import messages_formatter, messages_request
from gateway.api.relay import Choice
from gateway.api.responses.formatter import ResponsesFormatter
from gateway.api.responses.translate import new_response
from shared.types import FinishReason, RequestOutput, ToolCallDelta, Usage
from tests.response_parser_helpers import TOOLS, formats
from tests.responses_helpers import _parse, _request
from tests.test_anthropic_tools import body, events_of, streamed
from worker.parsing.response import ResponseParser

# A slow reader merged these deltas: the rest of call 0's arguments, then the answer text
# the model wrote after the call (the parser emits them in that order).
AFTER_CALL = [
    RequestOutput(
        "r",
        "",
        [1],
        tool_calls=[ToolCallDelta(0, "call_a", "f"), ToolCallDelta(0, arguments='{"a"')],
    ),
    RequestOutput(
        "r", "Done.", [2, 3], tool_calls=[ToolCallDelta(0, arguments=": 1}")], usage=Usage(5, 3)
    ),
    RequestOutput("r", "", [4], FinishReason.TOOL_CALLS, Usage(5, 4)),
]


def _parser_run(text: str) -> list[ToolCallDelta]:
    parser = ResponseParser(formats("json_tools"), "normal", TOOLS)
    parsed = parser.feed(text)
    parsed += parser.finish()
    return parsed.calls


def test_anthropic_merged_call_fragment_then_text() -> None:
    req = body(tools=[{"name": "f", "input_schema": {"type": "object"}}])
    fmt = messages_formatter(req, messages_request(req)[0])
    events = events_of(streamed(fmt, AFTER_CALL))
    stopped: set[int] = set()
    for event in events:
        if event["type"] == "content_block_stop":
            stopped.add(event["index"])
        if event["type"] == "content_block_delta":
            assert event["index"] not in stopped, f"delta after stop: {event}"


def test_responses_merged_call_fragment_then_text() -> None:
    fmt = ResponsesFormatter(new_response(_request()))
    raw = fmt.stream_start(AFTER_CALL[0])
    for output in AFTER_CALL:
        raw += fmt.stream_delta(0, output)
    raw += fmt.stream_finish(0, AFTER_CALL[-1]) + fmt.stream_end(Usage(5, 4))
    final = _parse(raw)[-1][1]["response"]
    calls = [item for item in final["output"] if item["type"] == "function_call"]
    assert [(c["call_id"], c["name"], c["arguments"]) for c in calls] == [
        ("call_a", "f", '{"a": 1}')
    ]


def test_anthropic_default_thinking_stream_matches_body() -> None:
    req = body()  # no thinking field: the template decides (Qwen3 thinks)
    fmt = messages_formatter(req, messages_request(req)[0], model_thinks=True)
    outputs = [
        RequestOutput("r", "", [1], reasoning="hmm", usage=Usage(5, 1)),
        RequestOutput("r", "Hi", [2]),
        RequestOutput("r", "", [3], FinishReason.STOP, Usage(5, 3)),
    ]
    starts = [
        e["content_block"]["type"]
        for e in events_of(streamed(fmt, outputs))
        if e["type"] == "content_block_start"
    ]
    choice = Choice(0)
    for output in outputs:
        choice.add(output)
    whole = json.loads(fmt.response([choice], Usage(5, 3)))
    assert starts == [block["type"] for block in whole["content"]]


def test_json_string_arguments_are_the_object() -> None:
    calls = _parser_run(
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'
        "\n</tool_call>"
    )
    arguments = "".join(c.arguments for c in calls)
    value: Any = json.loads(arguments)
    assert value == {"city": "Paris"}


def test_a_json_call_cut_short_keeps_what_was_streamed() -> None:
    """Its name and argument fragments have reached the client as generated: the call
    stays, cut (the finish reason says length); docs/api.md says so."""
    calls = _parser_run('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert calls[0].name == "get_weather"
    assert "".join(c.arguments for c in calls) == '{"city": "Pa'


def test_null_arguments_are_an_empty_object() -> None:
    calls = _parser_run('<tool_call>\n{"name": "get_time", "arguments": null}\n</tool_call>')
    assert "".join(c.arguments for c in calls) == "{}"
