"""The Responses API (/v1/responses) end to end: the official openai SDK (and raw HTTP where
the wire matters), the session's real gateway and its real worker processes."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.gateway_proc import GatewayProc, wait_for

LONG = 1900  # tokens: seconds of generation for the tiny model (its context is 2048)
# Exact token counts need no early EOS: greedy decoding (temperature 0) is deterministic, and
# the tiny model's greedy continuations of these prompts never end on their own.


def _tokens(gateway: GatewayProc, messages: list[dict[str, str]]) -> int:
    r = httpx.post(
        f"{gateway.base_url}/tokenize", json={"model": "chat", "messages": messages}, timeout=30
    )
    assert r.status_code == 200, r.text
    count: int = r.json()["count"]
    return count


def _post(gateway: GatewayProc, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gateway.base_url}/v1/responses", json=body, timeout=60)


def _events(gateway: GatewayProc, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    events = []
    with httpx.stream(
        "POST", f"{gateway.base_url}/v1/responses", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                assert name is not None
                events.append((name, json.loads(line[len("data: ") :])))
                name = None
    return events


def test_text_input(client: openai.OpenAI, gateway: GatewayProc) -> None:
    r = client.responses.create(
        model="chat", input="Tell me about the sea.", max_output_tokens=12, temperature=0
    )
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.model == "chat" and r.to_dict()["store"] is True and r.background is False
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.status == "incomplete"
    (part,) = item.content
    assert part.type == "output_text" and part.annotations == []
    assert r.output_text == part.text and r.output_text
    assert r.usage is not None
    assert r.usage.output_tokens == 12
    assert r.usage.input_tokens == _tokens(
        gateway, [{"role": "user", "content": "Tell me about the sea."}]
    )
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens_details.cached_tokens >= 0
    # The request's settings are echoed.
    assert r.max_output_tokens == 12 and r.temperature == 0 and r.top_p == 1.0
    assert r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls is True
    assert r.truncation == "disabled" and r.previous_response_id is None
    assert r.text is not None and r.text.format is not None and r.text.format.type == "text"


def test_message_input_and_accepted_fields(client: openai.OpenAI, gateway: GatewayProc) -> None:
    messages: list[Any] = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": "How are you?"},
    ]
    r = client.responses.create(
        model="chat",
        input=messages,
        max_output_tokens=5,
        temperature=0,
        top_p=0.9,
        metadata={"ticket": "42"},
        user="someone",
        tools=[],
        tool_choice="none",
        parallel_tool_calls=False,
        truncation="disabled",
        text={"format": {"type": "text"}},
        include=[],
        reasoning=None,
    )
    assert r.usage is not None and r.usage.output_tokens == 5
    expected = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
    ]
    assert r.usage.input_tokens == _tokens(gateway, expected)
    assert r.metadata == {"ticket": "42"} and r.user == "someone"
    assert r.temperature == 0 and r.top_p == 0.9
    assert r.tool_choice == "none" and r.parallel_tool_calls is False


def test_instructions_are_a_system_message(client: openai.OpenAI, gateway: GatewayProc) -> None:
    plain = client.responses.create(model="chat", input="Hi there", max_output_tokens=2)
    told = client.responses.create(
        model="chat", input="Hi there", instructions="Answer in French.", max_output_tokens=2
    )
    assert plain.usage is not None and told.usage is not None
    assert told.usage.input_tokens > plain.usage.input_tokens
    assert told.usage.input_tokens == _tokens(
        gateway,
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hi there"},
        ],
    )
    assert told.instructions == "Answer in French."


def test_greedy_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "chat",
        "input": "Once upon a time",
        "max_output_tokens": 24,
        "temperature": 0,
    }
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1]
    assert final.type == "response.incomplete"
    assert "".join(deltas) == whole.output_text
    assert final.response.output_text == whole.output_text
    assert final.response.usage is not None and whole.usage is not None
    assert final.response.usage.output_tokens == whole.usage.output_tokens == 24
    assert final.response.usage.input_tokens == whole.usage.input_tokens
    # The SDK's stream helper accumulates the same text.
    with client.responses.stream(**kwargs) as stream:
        helper = list(stream)
    done = [e for e in helper if e.type == "response.output_text.done"]
    assert [e.text for e in done] == [whole.output_text]
    snapshots = [e.snapshot for e in helper if e.type == "response.output_text.delta"]
    assert snapshots[-1] == whole.output_text


def test_stream_event_sequence(gateway: GatewayProc) -> None:
    events = _events(
        gateway, {"model": "chat", "input": "Hello", "max_output_tokens": 6, "temperature": 0}
    )
    names = [name for name, _ in events]
    assert [data["type"] for _, data in events] == names
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    deltas = names.count("response.output_text.delta")
    assert 1 <= deltas <= 6
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    data = dict(events)
    created = data["response.created"]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    item_id = data["response.output_item.added"]["item"]["id"]
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert all(d["delta"] for n, d in events if n == "response.output_text.delta")
    for name in ("response.output_text.done", "response.content_part.done"):
        assert data[name]["item_id"] == item_id
        assert data[name]["output_index"] == data[name]["content_index"] == 0
    assert data["response.output_text.done"]["text"] == text
    assert data["response.content_part.done"]["part"]["text"] == text
    item = data["response.output_item.done"]["item"]
    assert item["id"] == item_id and item["content"][0]["text"] == text
    final = data["response.incomplete"]["response"]
    assert final["id"] == created["id"] and final["status"] == "incomplete"
    assert final["output"] == [item]
    assert final["usage"]["output_tokens"] == 6
    # The streamed response was stored as it ended.
    stored = httpx.get(f"{gateway.base_url}/v1/responses/{final['id']}", timeout=10).json()
    assert stored == final


def test_chain_of_three(client: openai.OpenAI, gateway: GatewayProc) -> None:
    first = client.responses.create(
        model="chat", input="My name is Ada.", instructions="Be kind.", max_output_tokens=5
    )
    second = client.responses.create(
        model="chat",
        previous_response_id=first.id,
        input=[{"role": "user", "content": "What is my name?"}],
        instructions="Be brief.",
        max_output_tokens=5,
    )
    third = client.responses.create(
        model="chat", previous_response_id=second.id, input="Thanks.", max_output_tokens=5
    )
    assert second.previous_response_id == first.id and third.previous_response_id == second.id
    history = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.usage is not None and third.usage is not None
    # The previous instructions are not carried over; the new ones come first.
    assert second.usage.input_tokens == _tokens(
        gateway, [{"role": "system", "content": "Be brief."}, *history]
    )
    expected = [
        *history,
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Thanks."},
    ]
    assert third.usage.input_tokens == _tokens(gateway, expected)
    # input_items: what the model was given (instructions aside), newest first by default.
    items = client.responses.input_items.list(third.id)
    texts = [(i.role, i.content[0].text) for i in items.data]  # type: ignore[union-attr,index]
    assert texts == [(m["role"], m["content"]) for m in reversed(expected)]
    page = client.responses.input_items.list(third.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == [  # type: ignore[union-attr,index]
        "My name is Ada.",
        first.output_text,
    ]
    assert page.has_more is True
    rest = client.responses.input_items.list(third.id, order="asc", after=page.data[-1].id)
    assert len(rest.data) == 3 and rest.has_more is False


def test_retrieve_delete_and_unknown(client: openai.OpenAI, gateway: GatewayProc) -> None:
    made = client.responses.create(model="chat", input="Remember me", max_output_tokens=3)
    got = client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    r = httpx.delete(f"{gateway.base_url}/v1/responses/{made.id}", timeout=10)
    assert r.status_code == 200
    assert r.json() == {"id": made.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.retrieve(made.id)
    assert exc.value.status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(made.id)
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.retrieve("resp_0123")
    body = exc.value.body
    assert isinstance(body, dict) and body["code"] == "not_found"
    assert body["param"] == "response_id"
    r = _post(gateway, {"model": "chat", "input": "x", "previous_response_id": made.id})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "previous_response_id"


def test_store_false_is_not_kept(client: openai.OpenAI, gateway: GatewayProc) -> None:
    made = client.responses.create(
        model="chat", input="Forget me", max_output_tokens=3, store=False
    )
    assert made.to_dict()["store"] is False and made.usage is not None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(
            model="chat", input="again", previous_response_id=made.id, max_output_tokens=3
        )
    assert isinstance(exc.value.body, dict)
    assert exc.value.body["param"] == "previous_response_id"
    events = _events(
        gateway, {"model": "chat", "input": "x", "max_output_tokens": 2, "store": False}
    )
    response_id = events[0][1]["response"]["id"]
    r = httpx.get(f"{gateway.base_url}/v1/responses/{response_id}", timeout=10)
    assert r.status_code == 404


def test_background_runs_to_its_end(client: openai.OpenAI) -> None:
    made = client.responses.create(
        model="chat",
        input="Write a long story.",
        max_output_tokens=300,
        temperature=0,
        background=True,
    )
    assert made.status == "queued" and made.background is True and made.output == []
    seen: list[str | None] = [made.status]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = client.responses.retrieve(made.id).status
        if status != seen[-1]:
            seen.append(status)
        if status not in ("queued", "in_progress"):
            break
        time.sleep(0.01)
    assert seen[-1] == "incomplete"
    assert "in_progress" in seen and seen.index("in_progress") < len(seen) - 1
    done = client.responses.retrieve(made.id)
    assert done.usage is not None and done.usage.output_tokens == 300
    assert done.output_text
    # A finished response is returned unchanged by cancel, as OpenAI does.
    assert client.responses.cancel(made.id).model_dump() == done.model_dump()
    # It can be chained from.
    chained = client.responses.create(
        model="chat", previous_response_id=made.id, input="More.", max_output_tokens=2
    )
    assert chained.usage is not None
    assert chained.usage.input_tokens > done.usage.input_tokens + 100


def test_background_cancel_frees_the_worker(client: openai.OpenAI, gateway: GatewayProc) -> None:
    def idle() -> bool:
        row = gateway.ps()["chat"]
        return row["in_flight"] == 0 and row["running"] == 0

    # Cancelled right away: before or just after its generation started.
    made = client.responses.create(
        model="chat", input="Go on forever.", max_output_tokens=LONG, temperature=0, background=True
    )
    assert client.responses.cancel(made.id).status == "cancelled"
    # Cancelled mid-generation: aborted in the worker, what it had generated stays.
    made = client.responses.create(
        model="chat", input="Go on forever.", max_output_tokens=LONG, temperature=0, background=True
    )
    wait_for(lambda: client.responses.retrieve(made.id).status == "in_progress", 10, "a start")
    cancelled = client.responses.cancel(made.id)
    assert cancelled.status == "cancelled"
    assert cancelled.usage is not None and 0 < cancelled.usage.output_tokens < LONG
    assert cancelled.output[0].status == "incomplete"  # type: ignore[union-attr]
    assert client.responses.retrieve(made.id).model_dump() == cancelled.model_dump()
    assert client.responses.cancel(made.id).model_dump() == cancelled.model_dump()  # unchanged
    wait_for(idle, timeout=10, what="the worker to drop the cancelled generation")
    # Cancel by the request's id (POST /v1/requests/{id}/cancel) also ends it `cancelled`.
    r = _post(
        gateway,
        {
            "model": "chat",
            "input": "Again.",
            "max_output_tokens": LONG,
            "temperature": 0,
            "background": True,
        },
    )
    made_id, request_id = r.json()["id"], r.headers["x-request-id"]
    wait_for(lambda: client.responses.retrieve(made_id).status == "in_progress", 10, "a start")
    r = httpx.post(f"{gateway.base_url}/v1/requests/{request_id}/cancel", timeout=10)
    assert r.status_code == 200 and r.json()["cancelled_choices"] == 1
    wait_for(lambda: client.responses.retrieve(made_id).status == "cancelled", 10, "the cancel")
    wait_for(idle, timeout=10, what="the worker to drop the cancelled generation")
    r2 = client.responses.create(
        model="chat", input="Still there?", max_output_tokens=3, temperature=0
    )
    assert r2.usage is not None and r2.usage.output_tokens == 3


def test_background_failure_and_refusals(client: openai.OpenAI, gateway: GatewayProc) -> None:
    # Too long for the model's context: the task fails, the stored response says why.
    made = client.responses.create(
        model="chat", input="x", max_output_tokens=100_000, background=True
    )
    wait_for(lambda: client.responses.retrieve(made.id).status == "failed", 20, "the failure")
    failed = client.responses.retrieve(made.id)
    assert failed.error is not None and failed.error.code == "context_length_exceeded"
    # The same request in the foreground is a plain 400 naming this API's field.
    r = _post(gateway, {"model": "chat", "input": "x", "max_output_tokens": 100_000})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    foreground = client.responses.create(model="chat", input="x", max_output_tokens=2)
    r = httpx.post(f"{gateway.base_url}/v1/responses/{foreground.id}/cancel", timeout=10)
    assert r.status_code == 400
    assert "only background responses can be cancelled" in r.json()["error"]["message"]
    r = _post(gateway, {"model": "nope", "input": "x", "background": True})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


UNSUPPORTED = [
    ({"tools": [{"type": "web_search", "name": "f"}]}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}, "text.format.schema"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"background": True, "stream": True}, "background"),
    ({"background": True, "store": False}, "store"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"input": []}, "input"),
    (
        {"input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]},
        "input[0].call_id",
    ),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "input[0].extra"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0]"),
]


def test_a_text_model_refuses_images(gateway: GatewayProc) -> None:
    """Before the URL is fetched: the capability check names the request's `input`."""
    image = {"type": "input_image", "image_url": "https://example.com/cat.png"}
    body = {"model": "chat", "input": [{"role": "user", "content": [image]}]}
    r = _post(gateway, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input" and "it takes no images" in error["message"]


@pytest.mark.parametrize(("extra", "param"), UNSUPPORTED, ids=[p for _, p in UNSUPPORTED])
def test_unsupported_fields_are_400(
    gateway: GatewayProc, extra: dict[str, Any], param: str
) -> None:
    r = _post(gateway, {"model": "chat", "input": "hi", "max_output_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert param in error["message"]
