"""The Responses API's routes in process over a scripted supervisor: keys see only their
own responses, cached tokens reach the usage, a chain carries the history (not the
instructions), background responses and their cancel, and the store's bound and TTL from
the config."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from litestar.datastructures import State

from gateway.api.responses.routes import store_of
from shared.types import Message
from tests.responses_helpers import Clock, ScriptedWorkers, _app, _parse


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[ScriptedWorkers, httpx.AsyncClient, State]]:
    supervisor = ScriptedWorkers()
    app = _app(supervisor)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
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
    assert plain["usage"]["input_tokens_details"] == {"cached_tokens": 1, "cache_write_tokens": 0}
    r = await client.post("/v1/responses", json={**body, "stream": True})
    events = _parse(r.content)
    assert events[-1][0] == "response.completed"
    assert events[-1][1]["response"]["usage"]["input_tokens_details"] == {
        "cached_tokens": 1,
        "cache_write_tokens": 0,
    }


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
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
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
