"""The Responses API without worker processes: translation, the formatter's events, the
store's bound, TTL (fake clock) and key visibility, and the routes in process over a
scripted supervisor (keys, background, cancel)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import pytest
from litestar import Litestar
from litestar.datastructures import State

from gateway.api.common import decode_body
from gateway.api.relay import Choice
from gateway.api.responses.formatter import ResponsesFormatter
from gateway.api.responses.routes import responses_router, store_of
from gateway.api.responses.schemas import InputText, Item, MessageItem, ResponsesRequest
from gateway.api.responses.store import ResponseStore, StoredResponse
from gateway.api.responses.translate import (
    check_request,
    input_items,
    item_page,
    messages_of,
    new_response,
)
from gateway.api.serve import InFlight
from gateway.edge.context import RequestContext, new_request_id
from gateway.edge.keys import ApiKey
from gateway.edge.middleware import CONTEXT_KEY
from gateway.errors import GatewayError
from gateway.workers.client import RequestStream, Submission
from shared.config import Config, ServerConfig
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    FinishReason,
    Message,
    RequestOutput,
    Usage,
)

# ---- translation ---------------------------------------------------------------------------


def _request(**fields: Any) -> ResponsesRequest:
    return decode_body(
        json.dumps({"model": "m", "input": "hi", **fields}).encode(), ResponsesRequest
    )


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
    assert item.id.startswith("msg_") and item.type == "message" and item.status == "completed"
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
        ({"include": ["reasoning.encrypted_content"]}, "include"),
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


def _parse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        events.append((name_line[7:], json.loads(data_line[6:])))
    return events


def _out(text: str, ids: list[int], finish: FinishReason | None = None, **kw: Any) -> RequestOutput:
    return RequestOutput("r", text=text, token_ids=ids, finish_reason=finish, **kw)


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
        "input_tokens_details": {"cached_tokens": 6},
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
    assert failed["usage"]["input_tokens_details"] == {"cached_tokens": 3}
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
    assert body["usage"]["input_tokens_details"] == {"cached_tokens": 1}
    fmt.cancel()  # ended already: unchanged
    assert fmt.resp.status == "incomplete"
    running = ResponsesFormatter(new_response(_request(), status="queued"))
    running.cancel()
    assert running.resp.status == "cancelled" and running.resp.output == []


# ---- the store -----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _key(key_id: str, scope: str = "inference") -> ApiKey:
    return ApiKey(id=key_id, name=key_id, hash="0" * 64, created_at=0.0, scope=scope)  # type: ignore[arg-type]


def _entry(owner: str | None = None, status: str = "completed") -> StoredResponse:
    return StoredResponse(new_response(_request(), status=status), owner, [])


def test_store_bound_drops_the_oldest() -> None:
    store = ResponseStore(3, 60, Clock())
    entries = [_entry() for _ in range(5)]
    dropped = []
    for entry in entries:
        dropped += store.add(entry)
        store.ended(entry)
    assert dropped == entries[:2]
    assert len(store) == 3
    assert store.get(entries[0].id, None) is None
    assert store.get(entries[4].id, None) is entries[4]


def test_store_ttl_counts_from_the_end() -> None:
    clock = Clock()
    store = ResponseStore(10, 60, clock)
    running = _entry(status="queued")
    done = _entry()
    store.add(running)
    store.add(done)
    store.ended(done)
    clock.now += 59.9
    assert store.get(done.id, None) is done
    clock.now += 0.1
    assert store.get(done.id, None) is None
    assert store.get(running.id, None) is running  # a running one has no TTL yet
    clock.now += 1000
    assert store.get(running.id, None) is running
    store.ended(running)
    clock.now += 30
    assert store.get(running.id, None) is running
    clock.now += 30
    assert store.get(running.id, None) is None and len(store) == 0


def test_store_negative_ttl_keeps_until_dropped() -> None:
    clock = Clock()
    store = ResponseStore(1, -1, clock)
    first, second = _entry(), _entry()
    store.add(first)
    store.ended(first)
    clock.now += 1e9
    assert store.get(first.id, None) is first
    store.add(second)
    assert store.get(first.id, None) is None


def test_store_visibility_by_key() -> None:
    store = ResponseStore(10, 60, Clock())
    mine, open_one = _entry("k1"), _entry(None)
    store.add(mine)
    store.add(open_one)
    assert store.get(mine.id, _key("k1")) is mine
    assert store.get(mine.id, _key("k2")) is None
    assert store.get(mine.id, _key("boss", "admin")) is mine
    assert store.get(mine.id, None) is mine  # an open gateway: everyone
    assert store.get(open_one.id, _key("k1")) is None
    assert store.delete(mine.id, _key("k2")) is None
    assert store.delete(mine.id, _key("k1")) is mine
    assert store.get(mine.id, _key("k1")) is None


# ---- the routes, in process ----------------------------------------------------------------


class ScriptedWorkers:
    """Stands in for the workers' client: each request answers "Hello" in two deltas (prompt
    tokens = the number of messages, `cached` of them from the prefix cache), or, with
    `hold`, one delta and then nothing."""

    def __init__(self) -> None:
        self.hold = False
        self.cached = 0
        self.requests: list[CanonicalRequest] = []
        self.aborted: list[str] = []

    def resolve(self, name: str) -> Any:
        if name != "m":
            raise GatewayError(ErrorCode.MODEL_NOT_FOUND, f"no model {name!r}", "model")
        return SimpleNamespace(name=name)

    def must_load(self, name: str) -> bool:
        return False

    async def submit(self, submission: Submission) -> RequestStream:
        request = submission.request
        self.requests.append(request)
        rid = submission.request_id or new_request_id()
        stream = RequestStream(rid, submission.model, "w")
        prompt = len(request.messages)
        loop = asyncio.get_running_loop()
        cached = min(self.cached, prompt)
        loop.call_soon(stream.put, _out("Hel", [1], usage=Usage(prompt, 0, cached)))
        if not self.hold:
            last = _out("lo", [2], FinishReason.STOP, usage=Usage(prompt, 2, cached))
            loop.call_later(0.01, stream.put, last)
        return stream

    def abort(self, stream: RequestStream) -> None:
        self.aborted.append(stream.request_id)


KEYS = {"k1": _key("k1"), "k2": _key("k2"), "boss": _key("boss", "admin")}


def _app(workers: ScriptedWorkers, **server: Any) -> Callable[..., Any]:
    state = State(
        {
            "config": Config(server=ServerConfig(**server)),
            "workers": workers,
            "inflight": InFlight(),
            "finish_hooks": [],
        }
    )
    litestar = Litestar(route_handlers=[responses_router()], state=state)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        """As the gateway's middleware does: a context with the caller's key (if any)."""
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            key = KEYS.get(headers.get(b"x-api-key", b"").decode())
            ctx = RequestContext(new_request_id(), scope["method"], scope["path"], key=key)
            scope[CONTEXT_KEY] = ctx
        await litestar(scope, receive, send)

    app.state = state  # type: ignore[attr-defined]
    return app


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[ScriptedWorkers, httpx.AsyncClient, State]]:
    supervisor = ScriptedWorkers()
    app = _app(supervisor)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        yield supervisor, client, app.state  # type: ignore[attr-defined]


def _as(key: str) -> dict[str, str]:
    return {"x-api-key": key}


@pytest.mark.anyio
async def test_routes_keys_see_only_their_own(
    scripted: tuple[ScriptedWorkers, httpx.AsyncClient, State],
) -> None:
    _, client, _ = scripted
    r = await client.post("/v1/responses", json={"model": "m", "input": "hi"}, headers=_as("k1"))
    assert r.status_code == 200, r.text
    made = r.json()
    assert made["status"] == "completed" and made["output"][0]["content"][0]["text"] == "Hello"
    response_id = made["id"]
    assert (await client.get(f"/v1/responses/{response_id}", headers=_as("k1"))).json() == made
    assert (await client.get(f"/v1/responses/{response_id}", headers=_as("boss"))).json() == made
    other = await client.get(f"/v1/responses/{response_id}", headers=_as("k2"))
    assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"
    chained = await client.post(
        "/v1/responses",
        json={"model": "m", "input": "more", "previous_response_id": response_id},
        headers=_as("k2"),
    )
    assert chained.status_code == 404
    assert chained.json()["error"]["param"] == "previous_response_id"
    for method, path in (
        ("DELETE", f"/v1/responses/{response_id}"),
        ("GET", f"/v1/responses/{response_id}/input_items"),
        ("POST", f"/v1/responses/{response_id}/cancel"),
    ):
        r = await client.request(method, path, headers=_as("k2"))
        assert r.status_code == 404, (method, path)
    r = await client.delete(f"/v1/responses/{response_id}", headers=_as("k1"))
    assert r.json() == {"id": response_id, "object": "response.deleted", "deleted": True}
    r = await client.get(f"/v1/responses/{response_id}", headers=_as("k1"))
    assert r.status_code == 404


@pytest.mark.anyio
async def test_routes_report_cached_tokens(
    scripted: tuple[ScriptedWorkers, httpx.AsyncClient, State],
) -> None:
    """The worker's cached-token count reaches the body and the stream through the relay."""
    supervisor, client, _ = scripted
    supervisor.cached = 1
    body = {"model": "m", "input": "a", "instructions": "I"}
    plain = (await client.post("/v1/responses", json=body)).json()
    assert plain["usage"]["input_tokens"] == 2
    assert plain["usage"]["input_tokens_details"] == {"cached_tokens": 1}
    r = await client.post("/v1/responses", json={**body, "stream": True})
    events = _parse(r.content)
    assert events[-1][0] == "response.completed"
    assert events[-1][1]["response"]["usage"]["input_tokens_details"] == {"cached_tokens": 1}


@pytest.mark.anyio
async def test_routes_chain_carries_history_not_instructions(
    scripted: tuple[ScriptedWorkers, httpx.AsyncClient, State],
) -> None:
    supervisor, client, _ = scripted
    first = (
        await client.post("/v1/responses", json={"model": "m", "input": "a", "instructions": "I"})
    ).json()
    second = await client.post(
        "/v1/responses",
        json={
            "model": "m",
            "input": [{"role": "user", "content": "b"}],
            "previous_response_id": first["id"],
        },
    )
    assert second.status_code == 200
    assert supervisor.requests[-1].messages == [
        Message("user", "a"),
        Message("assistant", "Hello"),
        Message("user", "b"),
    ]
    assert supervisor.requests[0].messages == [Message("system", "I"), Message("user", "a")]
    items = (await client.get(f"/v1/responses/{second.json()['id']}/input_items?order=asc")).json()
    assert items["object"] == "list" and items["has_more"] is False
    assert [(i["role"], i["content"][0]["text"]) for i in items["data"]] == [
        ("user", "a"),
        ("assistant", "Hello"),
        ("user", "b"),
    ]
    assert items["data"][1]["content"][0]["type"] == "output_text"
    r = await client.get(f"/v1/responses/{first['id']}/input_items?limit=0")
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


@pytest.mark.anyio
async def test_routes_background_then_cancel(
    scripted: tuple[ScriptedWorkers, httpx.AsyncClient, State],
) -> None:
    supervisor, client, state = scripted
    r = await client.post("/v1/responses", json={"model": "m", "input": "a", "background": True})
    made = r.json()
    assert made["status"] == "queued" and made["background"] is True
    for _ in range(100):
        got = (await client.get(f"/v1/responses/{made['id']}")).json()
        if got["status"] == "completed":
            break
        await asyncio.sleep(0.01)
    assert got["output"][0]["content"][0]["text"] == "Hello"
    assert got["usage"]["output_tokens"] == 2
    # One that never finishes: in progress from its first delta, then cancelled.
    supervisor.hold = True
    held = (
        await client.post("/v1/responses", json={"model": "m", "input": "a", "background": True})
    ).json()
    for _ in range(100):
        if (await client.get(f"/v1/responses/{held['id']}")).json()["status"] == "in_progress":
            break
        await asyncio.sleep(0.01)
    cancelled = (await client.post(f"/v1/responses/{held['id']}/cancel")).json()
    assert cancelled["status"] == "cancelled"
    assert cancelled["output"][0]["content"][0]["text"] == "Hel"
    assert supervisor.aborted  # the worker was told
    assert store_of(state).get(held["id"], None) is not None
    again = (await client.post(f"/v1/responses/{held['id']}/cancel")).json()
    assert again == cancelled
    # Foreground responses cannot be cancelled.
    supervisor.hold = False
    fg = (await client.post("/v1/responses", json={"model": "m", "input": "a"})).json()
    r = await client.post(f"/v1/responses/{fg['id']}/cancel")
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "only background responses can be cancelled"


@pytest.mark.anyio
async def test_routes_store_bound_and_ttl_from_config() -> None:
    supervisor = ScriptedWorkers()
    app = _app(supervisor, responses_max_stored=2, responses_ttl="1m")
    state: State = app.state  # type: ignore[attr-defined]
    store = store_of(state)
    assert (store.max_stored, store.ttl_s) == (2, 60.0)
    clock = Clock()
    store.clock = clock
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        ids = []
        for _ in range(3):
            r = await client.post("/v1/responses", json={"model": "m", "input": "a"})
            ids.append(r.json()["id"])
        statuses = [(await client.get(f"/v1/responses/{i}")).status_code for i in ids]
        assert statuses == [404, 200, 200]
        clock.now += 61
        assert (await client.get(f"/v1/responses/{ids[2]}")).status_code == 404
        r = await client.post(
            "/v1/responses", json={"model": "m", "input": "a", "previous_response_id": ids[2]}
        )
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
        r = await client.post("/v1/responses", json={"model": "m", "input": "a", "store": False})
        assert r.status_code == 200 and r.json()["store"] is False
        assert (await client.get(f"/v1/responses/{r.json()['id']}")).status_code == 404
