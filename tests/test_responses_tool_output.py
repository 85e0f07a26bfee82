"""The Responses API's tool calls and reasoning on the way out, without worker processes:
the formatter's items and events (checked against the official openai SDK's types), and
over a scripted supervisor, chaining a stored response's calls into the next turn,
streamed and background, and refusals downstream naming this API's fields."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai.types.responses as sdk
import pytest
from litestar.datastructures import State

from gateway.api.relay import Choice
from gateway.api.responses.formatter import ResponsesFormatter
from gateway.api.responses.translate import new_response
from gateway.errors import GatewayError
from gateway.workers.client import RequestStream, Submission
from shared.types import (
    ErrorCode,
    FinishReason,
    Message,
    RequestOutput,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from tests.responses_helpers import (
    WEATHER,
    ScriptedWorkers,
    _app,
    _event,
    _parse,
    _request,
    _response,
)

# ---- the output ----------------------------------------------------------------------------


def _out(text: str = "", finish: FinishReason | None = None, **kw: Any) -> RequestOutput:
    return RequestOutput("r", text=text, token_ids=[1], finish_reason=finish, **kw)


def _call(index: int, args: str, call_id: str = "", name: str = "") -> ToolCallDelta:
    return ToolCallDelta(index, call_id, name, args)


def _stream(outputs: list[RequestOutput]) -> tuple[list[tuple[str, dict[str, Any]]], Any]:
    """Every event of a stream of these deltas (the last one terminal), each parsed by the
    SDK, and the final response as the SDK reads it."""
    fmt = ResponsesFormatter(new_response(_request()))
    raw = fmt.stream_start(outputs[0])
    for output in outputs:
        raw += fmt.stream_delta(0, output)
    raw += fmt.stream_finish(0, outputs[-1]) + fmt.stream_end(Usage(5, len(outputs), 0))
    events = _parse(raw)
    for _, data in events:
        _event(data)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    final = _response(events[-1][1]["response"])
    return events, final


def test_stream_reasoning_text_and_calls() -> None:
    events, final = _stream(
        [
            _out(reasoning="Let me ", usage=Usage(5, 0, 0)),
            _out(reasoning="see.", text="Checking."),
            _out(tool_calls=[_call(0, "", "call_a", "get_weather"), _call(0, '{"city":')]),
            _out(tool_calls=[_call(0, '"Oslo"}'), _call(1, "{}", "call_b", "now")]),
            _out(finish=FinishReason.TOOL_CALLS),
        ]
    )
    assert [n for n, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # reasoning
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # call 0
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",  # call 1
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    data = [d for _, d in events]
    assert data[2]["item"]["type"] == "reasoning" and data[2]["item"]["status"] == "in_progress"
    assert data[3]["part"] == {"type": "reasoning_text", "text": ""}
    assert data[6]["text"] == "Let me see." and data[6]["output_index"] == 0
    assert data[11]["output_index"] == 1 and data[11]["delta"] == "Checking."
    added = data[15]["item"]
    assert added["type"] == "function_call" and added["arguments"] == ""
    assert (added["call_id"], added["name"], added["status"]) == (
        "call_a",
        "get_weather",
        "in_progress",
    )
    assert data[16]["item_id"] == added["id"] and data[16]["output_index"] == 2
    assert data[18]["arguments"] == '{"city":"Oslo"}'
    assert data[19]["item"]["status"] == "completed" and data[23]["output_index"] == 3
    assert final.status == "completed" and final.output_text == "Checking."
    assert [item.type for item in final.output] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    reasoning, _, first, second = final.output
    assert isinstance(reasoning, sdk.ResponseReasoningItem) and reasoning.summary == []
    assert reasoning.content is not None and reasoning.content[0].text == "Let me see."
    assert isinstance(first, sdk.ResponseFunctionToolCall)
    assert isinstance(second, sdk.ResponseFunctionToolCall)
    assert (first.call_id, first.name, first.arguments) == (
        "call_a",
        "get_weather",
        '{"city":"Oslo"}',
    )
    assert (second.call_id, second.arguments, second.status) == ("call_b", "{}", "completed")
    assert first.id is not None and first.id.startswith("fc_") and reasoning.id.startswith("rs_")


def test_stream_calls_only_have_no_message() -> None:
    _, final = _stream(
        [
            _out(tool_calls=[_call(0, "{}", "c", "now")], usage=Usage(5, 0, 0)),
            _out(finish=FinishReason.TOOL_CALLS),
        ]
    )
    assert [item.type for item in final.output] == ["function_call"]
    assert final.output_text == ""


def test_stream_reasoning_only_and_out_of_tokens() -> None:
    """A turn that runs out in its thinking: the reasoning is incomplete, then an empty
    answer (a message item is there whenever no call was made)."""
    events, final = _stream(
        [_out(reasoning="Hmm", usage=Usage(5, 0, 0)), _out(finish=FinishReason.LENGTH)]
    )
    names = [n for n, _ in events]
    assert names[-9:] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert final.status == "incomplete"
    assert [(item.type, item.status) for item in final.output] == [
        ("reasoning", "incomplete"),
        ("message", "incomplete"),
    ]


def test_stream_error_mid_call_keeps_what_came() -> None:
    fmt = ResponsesFormatter(new_response(_request()))
    first = _out(tool_calls=[_call(0, '{"a', "c", "f")], usage=Usage(5, 0, 0))
    raw = fmt.stream_start(first) + fmt.stream_delta(0, first)
    raw += fmt.stream_error(GatewayError(ErrorCode.WORKER_DIED, "the worker died"))
    events = _parse(raw)
    for _, data in events:
        _event(data)
    failed = _response(events[-1][1]["response"])
    assert failed.status == "failed"
    call = failed.output[0]
    assert isinstance(call, sdk.ResponseFunctionToolCall)
    assert (call.arguments, call.status) == ('{"a', "incomplete")


def test_body_with_reasoning_and_calls() -> None:
    fmt = ResponsesFormatter(new_response(_request()))
    choice = Choice(
        0,
        thoughts=["think"],
        tool_calls=[ToolCall("c1", "f", '{"x":1}'), ToolCall("c2", "g", "{}")],
        finish_reason=FinishReason.TOOL_CALLS,
    )
    body = fmt.response([choice], Usage(5, 9, 0))
    response = _response(body)
    assert response.status == "completed"
    assert [item.type for item in response.output] == [
        "reasoning",
        "function_call",
        "function_call",
    ]
    assert json.loads(body)["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    with_text = Choice(0, pieces=["Hi"], thoughts=["r"], finish_reason=FinishReason.STOP)
    response = _response(
        ResponsesFormatter(new_response(_request())).response([with_text], Usage(5, 2, 0))
    )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output_text == "Hi"


# ---- the routes: chaining calls, background ------------------------------------------------


class CallingWorkers(ScriptedWorkers):
    """Thinks, then calls get_weather (call id call_<n>); answers "Sunny." once the last
    message is a tool result. Structured output and a reasoning effort are refused as by a
    model without them (naming the chat completions' fields)."""

    async def submit(self, submission: Submission) -> RequestStream:
        request = submission.request
        for need, param in (
            ("structured_output", "response_format"),
            ("reasoning", "reasoning_effort"),
        ):
            if need in submission.needs:
                raise GatewayError(ErrorCode.INVALID_REQUEST, f"no {need}", param)
        self.requests.append(request)
        stream = RequestStream(submission.request_id or "r", submission.model, "w")
        usage = Usage(len(request.messages), 2, 0)
        if request.messages[-1].role == "tool":
            script = [_out("Sunny.", FinishReason.STOP, usage=usage)]
        else:
            call = _call(0, '{"city":"Oslo"}', f"call_{len(self.requests)}", "get_weather")
            script = [
                _out(reasoning="Weather?", usage=Usage(len(request.messages), 0, 0)),
                _out(tool_calls=[call], finish=FinishReason.TOOL_CALLS, usage=usage),
            ]
        loop = asyncio.get_running_loop()
        for i, output in enumerate(script):
            loop.call_later(0.001 * i, stream.put, output)
        return stream


@pytest.fixture
async def calling() -> AsyncIterator[tuple[CallingWorkers, httpx.AsyncClient, State]]:
    workers = CallingWorkers()
    app = _app(workers)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        yield workers, client, app.state  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_chained_calls_complete_the_history(
    calling: tuple[CallingWorkers, httpx.AsyncClient, State],
) -> None:
    workers, client, _ = calling
    first = await client.post(
        "/v1/responses", json={"model": "m", "input": "Weather in Oslo?", "tools": [WEATHER]}
    )
    made = _response(first.content)
    call = made.output[-1]
    assert isinstance(call, sdk.ResponseFunctionToolCall) and call.call_id == "call_1"
    assert workers.requests[0].tools[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "12C"}
    second = await client.post(
        "/v1/responses",
        json={"model": "m", "input": [result], "previous_response_id": made.id, "tools": [WEATHER]},
    )
    assert second.status_code == 200, second.text
    assert _response(second.content).output_text == "Sunny."
    assert workers.requests[-1].messages == [
        Message("user", "Weather in Oslo?"),
        Message(
            "assistant",
            tool_calls=[ToolCall("call_1", "get_weather", '{"city":"Oslo"}')],
            reasoning="Weather?",
        ),
        Message("tool", "12C", tool_call_id="call_1"),
    ]
    listed = await client.get(f"/v1/responses/{second.json()['id']}/input_items?order=asc")
    items = sdk.ResponseItemList.model_validate_json(listed.content)
    assert [item.type for item in items.data] == [
        "message",
        "reasoning",
        "function_call",
        "function_call_output",
    ]
    # A result for a call nobody made.
    stray = await client.post(
        "/v1/responses",
        json={
            "model": "m",
            "input": [{**result, "call_id": "call_9"}],
            "previous_response_id": made.id,
        },
    )
    assert stray.status_code == 400 and stray.json()["error"]["param"] == "input[0].call_id"


@pytest.mark.anyio
async def test_streamed_and_background_calls(
    calling: tuple[CallingWorkers, httpx.AsyncClient, State],
) -> None:
    _, client, _ = calling
    body = {"model": "m", "input": "Weather?", "tools": [WEATHER]}
    streamed = await client.post("/v1/responses", json={**body, "stream": True})
    events = _parse(streamed.content)
    for _, data in events:
        _event(data)
    assert events[-1][0] == "response.completed"
    assert [i["type"] for i in events[-1][1]["response"]["output"]] == [
        "reasoning",
        "function_call",
    ]
    made = (await client.post("/v1/responses", json={**body, "background": True})).json()
    for _ in range(100):
        got = (await client.get(f"/v1/responses/{made['id']}")).json()
        if got["status"] == "completed":
            break
        await asyncio.sleep(0.01)
    stored = _response(got)
    assert [item.type for item in stored.output] == ["reasoning", "function_call"]
    call = stored.output[1]
    assert isinstance(call, sdk.ResponseFunctionToolCall)
    chained = await client.post(
        "/v1/responses",
        json={
            "model": "m",
            "input": [{"type": "function_call_output", "call_id": call.call_id, "output": "1"}],
            "previous_response_id": made["id"],
        },
    )
    assert chained.status_code == 200, chained.text


@pytest.mark.anyio
async def test_refusals_downstream_name_this_apis_fields(
    calling: tuple[CallingWorkers, httpx.AsyncClient, State],
) -> None:
    _, client, _ = calling
    for fields, param in (
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
    ):
        r = await client.post("/v1/responses", json={"model": "m", "input": "x", **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param
