"""The console's routes: the page and its assets (open: they hold no data), and its API under
/console/api (a key once any key exists, as /v1 needs; model control: an admin-scope key).

The page keeps the key in the browser's session storage and sends it as a header on each
call; nothing authenticates by cookie or URL, so no other site can make a browser act here
(no ambient credentials: CSRF is impossible by construction). Every state change is a POST.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, Response, Router, get, post
from litestar.params import FromPath
from litestar.response import File, Redirect, ServerSentEvent
from litestar.static_files import create_static_files_router

from gateway.console.live import LiveFigures
from gateway.console.recent import RecentRequests
from gateway.edge.context import RequestContext
from gateway.edge.middleware import context_of, may_use
from gateway.errors import GatewayError
from gateway.workers.supervisor import Supervisor
from shared.types import ErrorCode

STATIC = Path(__file__).parent / "static"
RECENT_SHOWN = 100

# The page runs only its own files: no inline script, nothing from elsewhere, not framed.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-cache",
}


def _ctx(request: Request[Any, Any, Any]) -> RequestContext | None:
    return context_of(request.scope)


def session(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """Who the page speaks for: the key's name and scope, and what it may do."""
    ctx = _ctx(request)
    key = ctx.key if ctx is not None else None
    state = request.app.state
    return {
        "auth_required": state.key_store.auth_required,
        "key": None if key is None else {"name": key.name, "scope": key.scope},
        # model control needs an admin-scope key, always: with no keys at all the console
        # shows the models and the playground, and says how to make one
        "can_control": key is not None and key.scope == "admin",
        "version": state.supervisor.status()["version"],
    }


def _visible_rows(request: Request[Any, Any, Any]) -> list[dict[str, Any]]:
    """The models' rows of `gatewayctl ps` that the caller's key may use."""
    supervisor: Supervisor = request.app.state.supervisor
    ctx = _ctx(request)
    key = ctx.key if ctx is not None else None
    rows = supervisor.ps()
    if key is None or key.scope == "admin":
        return rows

    def canonical(name: str) -> str:
        return supervisor.resolve(name).name

    return [row for row in rows if may_use(key, str(row["model"]), canonical)]


def _recent(request: Request[Any, Any, Any], after: int = 0) -> list[dict[str, Any]]:
    recent: RecentRequests = request.app.state.recent
    ctx = _ctx(request)
    key = ctx.key if ctx is not None else None
    own = None if key is None or key.scope == "admin" else key.id
    return recent.latest(RECENT_SHOWN, own, after)


def _figures(point: dict[str, Any], models: set[str]) -> dict[str, Any]:
    """A sample cut to the models the caller sees."""
    return {"t": point["t"], "models": {m: v for m, v in point["models"].items() if m in models}}


def _gateway(request: Request[Any, Any, Any], names: set[str]) -> dict[str, Any]:
    """The machine: version, uptime, memory budget and use (and the models the caller sees)."""
    supervisor: Supervisor = request.app.state.supervisor
    status: dict[str, Any] = supervisor.status()
    status["models"] = {m: s for m, s in status["models"].items() if m in names}
    return status


def _state(request: Request[Any, Any, Any]) -> dict[str, Any]:
    live: LiveFigures = request.app.state.live
    rows = _visible_rows(request)
    names = {str(row["model"]) for row in rows}
    return {
        "session": session(request),
        "gateway": _gateway(request, names),
        "models": rows,
        "interval_s": live.interval,
        "history": [_figures(p, names) for p in live.history()],
        "recent": _recent(request),
    }


@get("/api/state", sync_to_thread=False)
def state_route(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """Everything the page shows, once: models, the machine, the figures' history, recent
    requests."""
    return _state(request)


@get("/api/live")
async def live_route(request: Request[Any, Any, Any]) -> ServerSentEvent:
    """Server-sent events: `state` (as /api/state) first, then an `update` per sample:
    the sample, the models' rows, the machine and the requests finished since."""
    live: LiveFigures = request.app.state.live

    async def events() -> AsyncIterator[dict[str, str]]:
        queue = live.watch()
        try:
            first = _state(request)
            seq = max((r["seq"] for r in first["recent"]), default=0)
            yield {"event": "state", "data": _json(first)}
            while True:
                point = await queue.get()
                if not _still_allowed(request):
                    return  # a revoked or expired key, or keys now needed: the page asks again
                rows = _visible_rows(request)
                names = {str(row["model"]) for row in rows}
                recent = _recent(request, seq)
                seq = max((r["seq"] for r in recent), default=seq)
                update = {
                    "sample": _figures(point, names),
                    "models": rows,
                    "gateway": _gateway(request, names),
                    "recent": recent,
                }
                yield {"event": "update", "data": _json(update)}
        finally:
            live.unwatch(queue)

    return ServerSentEvent(events(), headers={"cache-control": "no-store"})


def _still_allowed(request: Request[Any, Any, Any]) -> bool:
    """Whether the key that opened a live stream would still be let in."""
    keys = request.app.state.key_store
    ctx = _ctx(request)
    key = ctx.key if ctx is not None else None
    if key is None:
        return not keys.auth_required
    current = keys.refresh().get(key.id)
    return current is not None and current.active()


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def _admin_only(request: Request[Any, Any, Any]) -> None:
    ctx = _ctx(request)
    key = ctx.key if ctx is not None else None
    if key is None:
        raise GatewayError(
            ErrorCode.FORBIDDEN,
            "loading and unloading models from the console needs an admin-scope key: "
            "create one with `gatewayctl keys create NAME --scope admin`",
        )
    if key.scope != "admin":
        raise GatewayError(
            ErrorCode.FORBIDDEN, f"key {key.name!r} has scope {key.scope!r}, not admin"
        )


@post("/api/models/{model:str}/{action:str}", status_code=200)
async def control_route(
    request: Request[Any, Any, Any], model: FromPath[str], action: FromPath[str]
) -> Any:
    """load (returns once it is on its way: the page follows its state), unload (waits for
    its requests, as `gatewayctl unload` does), reload (returns when the new worker serves)."""
    _admin_only(request)
    supervisor: Supervisor = request.app.state.supervisor
    name = supervisor.resolve(model).name
    ctx = _ctx(request)
    if ctx is not None:
        ctx.model = name
    if action == "load":
        slot = await supervisor.load(name, wait=False)
        return {"model": name, "state": slot.state.value}
    if action == "unload":
        unloaded = await supervisor.unload(name)
        return {"model": name, "unloaded": unloaded}
    if action == "reload":
        handle = await supervisor.reload(name)
        return {"model": name, "pid": handle.pid, "state": "ready"}
    raise GatewayError(
        ErrorCode.NOT_FOUND, f"unknown action {action!r}: load, unload or reload", "action"
    )


@get("/", sync_to_thread=False)
def page() -> File:
    return File(STATIC / "index.html", content_disposition_type="inline", media_type="text/html")


def _secure(response: Response[Any]) -> Response[Any]:
    response.headers.update(SECURITY_HEADERS)
    return response


@get("/", sync_to_thread=False, include_in_schema=False)
def root(request: Request[Any, Any, Any]) -> Response[Any]:
    """A browser at the gateway's address lands on the console; an API client learns where
    things are."""
    if "text/html" in request.headers.get("accept", ""):
        return Redirect("/console", status_code=307)
    return Response({"service": "mlx-gateway", "api": "/v1", "console": "/console"})


def console_router() -> Router:
    assets = create_static_files_router(path="/assets", directories=[STATIC / "assets"])
    return Router(
        path="/console",
        route_handlers=[page, state_route, live_route, control_route, assets],
        include_in_schema=False,
        after_request=_secure,
    )


def console_handlers() -> list[Any]:
    return [console_router(), root]


async def sampling(live: LiveFigures) -> None:
    """The lifespan's task: samples until cancelled."""
    with contextlib.suppress(asyncio.CancelledError):
        await live.run()
