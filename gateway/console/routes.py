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

from gateway.api.common import decode_body
from gateway.console.live import LiveFigures
from gateway.console.recent import RecentRequests
from gateway.edge.context import RequestContext
from gateway.edge.middleware import context_of, may_use
from gateway.errors import GatewayError
from gateway.workers.supervisor import Supervisor
from shared.types import ErrorCode
from shared.version import project_version

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
    "cache-control": "no-cache",  # the page and assets: revalidated, so an update shows
}
# The API's answers are the key's own view: never stored by the browser.
NO_STORE = {"cache-control": "no-store"}


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
        "version": project_version(),
    }


# What an inference key sees of a model's row: its status, not where its files are, its
# processes or its logs (those are the operator's: an admin key, or gatewayctl).
STATUS_FIELDS = (
    "model",
    "kind",
    "state",
    "aliases",
    "memory_bytes",
    "rss_bytes",
    "running",
    "waiting",
    "in_flight",
    "served",
    "restarts",
    "uptime_s",
    "ttl_s",
    "ttl_left_s",
    "next_attempt_s",
    "prefix_cache",
    "prompt_segments",
)
GATEWAY_FIELDS = (
    "version",
    "uptime_s",
    "device",
    "models",
    "memory_budget_bytes",
    "memory_used_bytes",
    "memory_total_bytes",
)


def _operator(ctx: RequestContext | None) -> bool:
    """An admin key, or no keys at all (an open gateway: its local user)."""
    return ctx is None or ctx.key is None or ctx.key.scope == "admin"


def _visible_rows(request: Request[Any, Any, Any]) -> list[dict[str, Any]]:
    """The models' rows of `gatewayctl ps` that the caller's key may use."""
    supervisor: Supervisor = request.app.state.supervisor
    ctx = _ctx(request)
    rows = supervisor.ps()
    if _operator(ctx):
        return rows
    assert ctx is not None and ctx.key is not None

    def canonical(name: str) -> str:
        return supervisor.resolve(name).name

    return [
        {field: row.get(field) for field in STATUS_FIELDS}
        for row in rows
        if may_use(ctx.key, str(row["model"]), canonical)
    ]


def _recent(request: Request[Any, Any, Any], after: int = 0) -> list[dict[str, Any]]:
    recent: RecentRequests = request.app.state.recent
    ctx = _ctx(request)
    own = None if _operator(ctx) else ctx.key.id  # type: ignore[union-attr]
    return recent.latest(RECENT_SHOWN, own, after)


def _figures(point: dict[str, Any], models: set[str]) -> dict[str, Any]:
    """A sample cut to the models the caller sees."""
    return {"t": point["t"], "models": {m: v for m, v in point["models"].items() if m in models}}


def _gateway(request: Request[Any, Any, Any], names: set[str]) -> dict[str, Any]:
    """The machine: version, uptime, memory budget and use (and the models the caller sees)."""
    supervisor: Supervisor = request.app.state.supervisor
    status: dict[str, Any] = supervisor.status()
    status["models"] = {m: s for m, s in status["models"].items() if m in names}
    if not _operator(_ctx(request)):
        status = {field: status[field] for field in GATEWAY_FIELDS if field in status}
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
def state_route(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
    """Everything the page shows, once: models, the machine, the figures' history, recent
    requests."""
    return Response(_state(request), headers=NO_STORE)


@get("/api/live")
async def live_route(request: Request[Any, Any, Any]) -> Response[Any]:
    """Server-sent events: `state` (as /api/state) first, then an `update` per sample:
    the sample, the models' rows, the machine and the requests finished since."""
    live: LiveFigures = request.app.state.live
    ctx = _ctx(request)
    owner = ctx.key.id if ctx is not None and ctx.key is not None else ""
    queue = live.watch(owner)  # refused past the limits on open streams (503)

    async def events() -> AsyncIterator[dict[str, str]]:
        try:
            first = _state(request)
            seq = max((r["seq"] for r in first["recent"]), default=0)
            yield {"event": "state", "data": _json(first)}
            while True:
                point = await live.next(queue)
                supervisor: Supervisor = request.app.state.supervisor
                if point is None or supervisor.draining or not _still_allowed(request):
                    # a reader dropped for not reading, a revoked or expired key, keys now
                    # needed, or the gateway shutting down (an open tab must not hold its
                    # drain): the stream ends (the page asks again)
                    return
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

    return ServerSentEvent(events(), headers=NO_STORE)


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


class ControlBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str  # a name or alias; any characters ("org/repo" included)


@post("/api/models/{action:str}", status_code=200)
async def control_route(request: Request[Any, Any, Any], action: FromPath[str]) -> Any:
    """`{"model": NAME}` to load (returns once it is on its way: the page follows its
    state), unload (waits for its requests, as `gatewayctl unload` does) or reload (returns
    when the new worker serves)."""
    _admin_only(request)
    if action not in ACTIONS:
        raise GatewayError(
            ErrorCode.NOT_FOUND, f"unknown action {action!r}: load, unload or reload", "action"
        )
    body = decode_body(await request.body(), ControlBody)
    supervisor: Supervisor = request.app.state.supervisor
    name = supervisor.resolve(body.model).name
    ctx = _ctx(request)
    if ctx is not None:
        ctx.model, ctx.model_known = name, True
    if action == "load":
        slot = await supervisor.load(name, wait=False)
        return {"model": name, "state": slot.state.value}
    if action == "unload":
        return {"model": name, "unloaded": await supervisor.unload(name)}
    handle = await supervisor.reload(name)
    return {"model": name, "pid": handle.pid, "state": "ready"}


ACTIONS = ("load", "unload", "reload")


@get("/", sync_to_thread=False)
def page() -> File:
    return File(STATIC / "index.html", content_disposition_type="inline", media_type="text/html")


def _secure(response: Response[Any]) -> Response[Any]:
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)  # the API's own no-store stays
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
