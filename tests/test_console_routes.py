"""The console's routes in process (the real app and middleware; workers never started):
who may see and do what, the page's headers, the live stream's end when a key goes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import GatewayApp, create_app
from gateway.console.live import LiveFigures
from gateway.edge.context import RequestContext
from gateway.edge.keys import KeyStore
from shared.config import Config, ModelConfig, ServerConfig


def make_app(folder: Path, **server: Any) -> GatewayApp:
    settings = {"keys_file": str(folder / "keys.json"), "run_dir": str(folder), **server}
    models = [
        ModelConfig(name="a", source="/nowhere", preload=False),
        ModelConfig(name="b", source="/nowhere", aliases=["bee"], preload=False),
        # as `gatewayctl load org/repo --source ...` names one
        ModelConfig(name="org/repo", source="/nowhere/else", preload=False),
    ]
    return create_app(Config(server=ServerConfig(**settings), models=models))


def call(app: GatewayApp, method: str, path: str, key: str | None = None, **kw: Any) -> Any:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        headers = {"authorization": f"Bearer {key}"} if key else {}
        headers |= kw.pop("headers", {})
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.request(method, path, headers=headers, timeout=10, **kw)

    return asyncio.run(go())


@pytest.fixture
def open_app(tmp_path: Path) -> GatewayApp:
    return make_app(tmp_path)


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[GatewayApp, dict[str, str]]]:
    store = KeyStore(tmp_path / "keys.json")
    admin, _ = store.create("boss", scope="admin")
    user, _ = store.create("user", models=["bee"])
    other, _ = store.create("other")
    yield make_app(tmp_path), {"admin": admin, "user": user, "other": other}


def test_the_page_and_its_assets_are_served_with_a_strict_policy(open_app: GatewayApp) -> None:
    page = call(open_app, "GET", "/console")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    for src in (
        "/console/assets/console.js",
        "/console/assets/vendor/uplot-1.6.32/uPlot.iife.min.js",
    ):
        assert f'src="{src}"' in page.text
        asset = call(open_app, "GET", src)
        assert asset.status_code == 200 and "javascript" in asset.headers["content-type"]
    assert call(open_app, "GET", "/console/assets/nothing.js").status_code == 404


def test_a_browser_at_the_root_lands_on_the_console(open_app: GatewayApp) -> None:
    browser = call(open_app, "GET", "/", headers={"accept": "text/html,*/*"})
    assert browser.status_code == 307 and browser.headers["location"] == "/console"
    client = call(open_app, "GET", "/")
    assert client.status_code == 200 and client.json()["console"] == "/console"


def test_with_no_keys_the_state_is_open_and_control_needs_an_admin_key(
    open_app: GatewayApp,
) -> None:
    state = call(open_app, "GET", "/console/api/state").json()
    assert state["session"] == {
        "auth_required": False,
        "key": None,
        "can_control": False,
        "version": state["gateway"]["version"],
    }
    assert [m["model"] for m in state["models"]] == ["a", "b", "org/repo"]
    assert state["gateway"]["memory_budget_bytes"] > 0 and "uptime_s" in state["gateway"]
    refused = call(open_app, "POST", "/console/api/models/load", json={"model": "a"})
    assert refused.status_code == 403
    assert "gatewayctl keys create NAME --scope admin" in refused.json()["error"]["message"]


def test_once_keys_exist_the_api_needs_one(keyed: tuple[GatewayApp, dict[str, str]]) -> None:
    app, _ = keyed
    assert call(app, "GET", "/console").status_code == 200  # the page itself holds no data
    for method, path in [
        ("GET", "/console/api/state"),
        ("GET", "/console/api/live"),
        ("POST", "/console/api/models/unload"),
    ]:
        reply = call(app, method, path)
        assert reply.status_code == 401, path
        assert reply.json()["error"]["code"] == "unauthorized"
    assert call(app, "GET", "/console/api/state", "mgw-0-wrong").status_code == 401


def test_an_inference_key_sees_its_models_and_its_requests_only(
    keyed: tuple[GatewayApp, dict[str, str]],
) -> None:
    app, keys = keyed
    store: KeyStore = app.state.key_store
    for name, model in (("user", "b"), ("other", "a"), ("user", "b")):
        ctx = RequestContext(
            "r", "POST", "/v1/chat/completions", model=model, model_known=True, status=200
        )
        ctx.key = next(k for k in store.all() if k.name == name)
        app.state.recent.observe(ctx)
    state = call(app, "GET", "/console/api/state", keys["user"]).json()
    assert state["session"]["key"] == {"name": "user", "scope": "inference"}
    assert state["session"]["can_control"] is False
    assert [m["model"] for m in state["models"]] == ["b"]  # its key lists "bee", b's alias
    assert list(state["gateway"]["models"]) == ["b"]
    # its status, not the operator's: where the files are, processes, logs
    row = state["models"][0]
    assert row["state"] == "unloaded" and row["aliases"] == ["bee"]
    assert not {"source", "pid", "log_tail", "error", "exit_code", "draining"} & set(row)
    assert "pid" not in state["gateway"] and "memory_budget_bytes" in state["gateway"]
    assert [r["key"] for r in state["recent"]] == ["user", "user"]
    admin = call(app, "GET", "/console/api/state", keys["admin"]).json()
    assert [m["model"] for m in admin["models"]] == ["a", "b", "org/repo"]
    assert admin["models"][0]["source"] == "/nowhere" and "pid" in admin["gateway"]
    assert admin["session"]["can_control"] is True
    assert [r["key"] for r in admin["recent"]] == ["user", "other", "user"]


def test_control_needs_an_admin_key_a_post_and_a_known_model_and_action(
    keyed: tuple[GatewayApp, dict[str, str]],
) -> None:
    app, keys = keyed
    refused = call(app, "POST", "/console/api/models/unload", keys["user"], json={"model": "b"})
    assert refused.status_code == 403
    assert "scope 'inference', not admin" in refused.json()["error"]["message"]
    # no state change by GET (a link or an <img> can make a browser GET)
    assert call(app, "GET", "/console/api/models/unload", keys["admin"]).status_code == 405
    unknown = call(app, "POST", "/console/api/models/unload", keys["admin"], json={"model": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    bad = call(app, "POST", "/console/api/models/explode", keys["admin"], json={"model": "a"})
    assert bad.status_code == 404 and "load, unload or reload" in bad.json()["error"]["message"]
    for body in (b"", b"{", b'{"model": 1}', b'{"model": "a", "force": true}'):
        wrong = call(app, "POST", "/console/api/models/unload", keys["admin"], content=body)
        assert wrong.status_code == 400, body
    for name, canonical in (("bee", "b"), ("org/repo", "org/repo")):
        done = call(app, "POST", "/console/api/models/unload", keys["admin"], json={"model": name})
        assert done.status_code == 200 and done.json() == {"model": canonical, "unloaded": False}


def test_the_api_is_never_stored_by_the_browser(open_app: GatewayApp) -> None:
    assert call(open_app, "GET", "/console/api/state").headers["cache-control"] == "no-store"
    assert call(open_app, "GET", "/console").headers["cache-control"] == "no-cache"


def test_open_streams_are_bounded_per_key(keyed: tuple[GatewayApp, dict[str, str]]) -> None:
    app, keys = keyed
    live: LiveFigures = app.state.live
    user = next(k.id for k in app.state.key_store.all() if k.name == "user")
    for _ in range(live.max_per_key):
        live.watch(user)  # the key's other tabs
    over = call(app, "GET", "/console/api/live", keys["user"])
    assert over.status_code == 503 and over.headers["retry-after"] == "5"
    assert "too many open console streams" in over.json()["error"]["message"]
    assert live.watching == live.max_per_key  # the refused one left nothing behind


def test_the_console_can_be_switched_off(tmp_path: Path) -> None:
    app = make_app(tmp_path, console=False)
    for path in ("/console", "/console/api/state", "/console/assets/console.js"):
        assert call(app, "GET", path).status_code == 404, path
    assert call(app, "GET", "/", headers={"accept": "text/html"}).status_code == 404


def test_a_live_stream_ends_when_its_key_is_revoked(
    keyed: tuple[GatewayApp, dict[str, str]],
) -> None:
    app, keys = keyed
    live: LiveFigures = app.state.live

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        headers = {"authorization": f"Bearer {keys['other']}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            request = asyncio.create_task(client.get("/console/api/live", headers=headers))
            for _ in range(500):  # bounded: the stream watches once its first event is out
                if live.watching:
                    break
                await asyncio.sleep(0.01)
            live.publish(live.sample())  # the key is good: an update goes out
            for _ in range(500):
                if all(q.empty() for q in live._watchers):  # the update went out
                    break
                await asyncio.sleep(0.01)
            app.state.key_store.revoke("other")
            live.publish(live.sample())
            return await asyncio.wait_for(request, 10)

    reply = asyncio.run(go())
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [line for line in reply.text.splitlines() if line.startswith("event:")]
    assert events == ["event: state", "event: update"]
    assert live.watching == 0
