"""The Responses API without worker processes: the request's translation (input items,
each refusal naming its field, the settings echoed), pages of input items, and the
formatter's events and bodies (completed, failed, incomplete, cancelled)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from gateway.api.relay import Choice
from gateway.api.responses.formatter import ResponsesFormatter
from gateway.api.responses.schemas import InputText, Item, MessageItem
from gateway.api.responses.translate import (
    check_request,
    input_items,
    item_page,
    messages_of,
    new_response,
)
from gateway.errors import GatewayError
from shared.types import ErrorCode, FinishReason, Message, Usage
from tests.responses_helpers import _out, _parse, _request

# ---- translation ---------------------------------------------------------------------------


def _refusal(fields: dict[str, Any]) -> GatewayError:
    with pytest.raises(GatewayError) as exc:
        body = _request(**fields)
        check_request(body)
        assert body.input is not None
        input_items(body.input)
    assert exc.value.code == ErrorCode.INVALID_REQUEST
    return exc.value


def test_input_string_and_messages() -> None:
    (item,) = input_items("Hello")
    assert isinstance(item, MessageItem)
    assert item.role == "user" and item.content == [InputText("Hello")]
    assert item.id.startswith("msg_") and item.status == "completed"
    assert msgspec.to_builtins(item)["type"] == "message"  # the tag, first
    items = input_items(
        [
            {"role": "developer", "content": "Be brief."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "a"},
                    {"type": "input_text", "text": "b"},
                ],
            },
            # An earlier output passed back as is.
            {
                "id": "msg_1",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "c", "annotations": []}],
            },
        ]
    )
    assert msgspec.to_builtins(items[2]) == {  # passed back as it came
        "id": "msg_1",
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "c", "annotations": []}],
    }
    assert messages_of(items, "Rules.") == [
        Message("system", "Rules."),
        Message("system", "Be brief."),
        Message("user", "ab"),
        Message("assistant", "c"),
    ]
    assert messages_of(items[1:2], None) == [Message("user", "ab")]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]},
            "input[1].role",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
            "input[0].content[0].text",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a", "x": 1}]}]},
            "input[0].content[0].x",
        ),
        ({"input": [{"role": "user"}]}, "input[0]"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": None}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
        ({"reasoning": {"effort": "xhigh"}}, "reasoning.effort"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"background": True, "stream": True}, "background"),
        ({"background": True, "store": False}, "store"),
        ({"stream_options": {"include_usage": True}}, "stream_options.include_usage"),
        ({"seed": 1}, "seed"),
    ],
)
def test_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    error = _refusal(fields)
    assert error.param == param
    assert error.status == 400


def test_accepted_fields_echo() -> None:
    body = _request(
        tools=[],
        tool_choice="none",
        parallel_tool_calls=False,
        truncation="disabled",
        text={"format": {"type": "text"}},
        include=[],
        reasoning=None,
        metadata={"a": "b"},
        user="u",
        temperature=0.2,
        max_output_tokens=7,
        instructions="I",
        service_tier="auto",
        stream_options={"include_obfuscation": False},
        client_metadata={"x-codex-installation-id": "i"},  # Codex's, with every turn
    )
    check_request(body)
    response = msgspec.to_builtins(new_response(body))
    assert response["id"].startswith("resp_") and response["object"] == "response"
    assert response["status"] == "in_progress"
    assert response["tool_choice"] == "none" and response["parallel_tool_calls"] is False
    assert response["metadata"] == {"a": "b"} and response["user"] == "u"
    assert response["temperature"] == 0.2 and response["top_p"] == 1.0
    assert response["max_output_tokens"] == 7 and response["instructions"] == "I"
    assert response["text"] == {"format": {"type": "text"}} and response["tools"] == []
    assert response["truncation"] == "disabled" and response["output"] == []
    assert response["usage"] is None and response["error"] is None


def test_item_page() -> None:
    items: list[Item] = [
        MessageItem(id=f"m{i}", role="user", content=[InputText(str(i))]) for i in range(5)
    ]
    page = item_page(items, None, 2, "desc")
    assert page is not None
    assert [i.id for i in page.data] == ["m4", "m3"]
    assert (page.first_id, page.last_id, page.has_more) == ("m4", "m3", True)
    page = item_page(items, "m3", 10, "desc")
    assert page is not None and [i.id for i in page.data] == ["m2", "m1", "m0"]
    assert page.has_more is False
    page = item_page(items, "m1", 3, "asc")
    assert page is not None and [i.id for i in page.data] == ["m2", "m3", "m4"]
    assert item_page(items, "nope", 3, "asc") is None
    empty = item_page(items, "m4", 3, "asc")
    assert empty is not None and empty.data == [] and empty.first_id is None


# ---- the formatter -------------------------------------------------------------------------


def test_formatter_stream_completed() -> None:
    done: list[Any] = []
    fmt = ResponsesFormatter(new_response(_request()), done.append)
    first = _out("He", [1], usage=Usage(9, 0, 6))
    raw = fmt.stream_start(first) + fmt.stream_delta(0, first)
    raw += fmt.stream_delta(0, _out("", [2]))  # held-back bytes: no event
    last = _out("llo", [3], FinishReason.STOP, usage=Usage(9, 3, 6))
    raw += fmt.stream_delta(0, last) + fmt.stream_finish(0, last) + fmt.stream_end(Usage(9, 3, 6))
    events = _parse(raw)
    assert [n for n, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [d["sequence_number"] for _, d in events] == list(range(10))
    assert all(d["type"] == n for n, d in events)
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["incomplete_details"] is None
    assert final["output"][0]["status"] == "completed"
    assert final["output"][0]["content"] == [
        {"type": "output_text", "text": "Hello", "annotations": []}
    ]
    assert final["usage"] == {
        "input_tokens": 9,  # OpenAI's: the whole prompt, the cached part included
        "input_tokens_details": {"cached_tokens": 6, "cache_write_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 12,
    }
    assert final["completed_at"] is not None
    assert len(done) == 1 and done[0].status == "completed"


def test_formatter_error_mid_stream() -> None:
    done: list[Any] = []
    fmt = ResponsesFormatter(new_response(_request()), done.append)
    first = _out("Hi", [1, 2], usage=Usage(4, 0, 3))
    raw = fmt.stream_start(first) + fmt.stream_delta(0, first)
    raw += fmt.stream_error(GatewayError(ErrorCode.WORKER_DIED, "the worker died"))
    events = _parse(raw)
    assert [n for n, _ in events][-2:] == ["error", "response.failed"]
    error = events[-2][1]
    assert error["code"] == "worker_died" and error["message"] == "the worker died"
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "worker_died", "message": "the worker died"}
    assert failed["output"][0]["status"] == "incomplete"
    assert failed["output"][0]["content"][0]["text"] == "Hi"
    assert failed["usage"]["output_tokens"] == 2 and failed["usage"]["input_tokens"] == 4
    assert failed["usage"]["input_tokens_details"] == {"cached_tokens": 3, "cache_write_tokens": 0}
    assert failed["completed_at"] is None
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert len(done) == 1


def test_formatter_error_before_start() -> None:
    """A model that fails to load while a stream waits: the events still open properly."""
    fmt = ResponsesFormatter(new_response(_request()))
    events = _parse(fmt.stream_error(GatewayError(ErrorCode.WORKER_UNAVAILABLE, "no")))
    assert [n for n, _ in events] == [
        "response.created",
        "response.in_progress",
        "error",
        "response.failed",
    ]
    assert events[-1][1]["response"]["output"] == []


def test_formatter_non_stream_and_cancel() -> None:
    fmt = ResponsesFormatter(new_response(_request(max_output_tokens=2)))
    choice = Choice(0, pieces=["a", "b"], finish_reason=FinishReason.LENGTH)
    body = json.loads(fmt.response([choice], Usage(5, 2, 1)))
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == "ab"
    assert body["usage"]["input_tokens_details"] == {"cached_tokens": 1, "cache_write_tokens": 0}
    fmt.cancel()  # ended already: unchanged
    assert fmt.resp.status == "incomplete"
    running = ResponsesFormatter(new_response(_request(), status="queued"))
    running.cancel()
    assert running.resp.status == "cancelled" and running.resp.output == []
