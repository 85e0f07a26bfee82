"""Admin API for gatewayctl, served on a unix socket (0600) beside the public HTTP port."""

from __future__ import annotations

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.exceptions import HTTPException

from gateway.errors import GatewayError
from gateway.supervisor import Supervisor


class LoadBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    wait: bool = True


class UnloadBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    force: bool = False
    timeout_s: float = 30.0


def _error(_: Request, exc: Exception) -> Response[dict[str, str]]:
    if isinstance(exc, GatewayError):
        return Response({"error": exc.message, "code": exc.code.value}, status_code=exc.status)
    if isinstance(exc, HTTPException):
        return Response({"error": str(exc.detail)}, status_code=exc.status_code)
    return Response({"error": repr(exc)}, status_code=500)


@get("/ps")
async def ps(state: State) -> list[dict[str, object]]:
    supervisor: Supervisor = state.supervisor
    return supervisor.ps()


@post("/load", status_code=200)
async def load(state: State, data: LoadBody) -> dict[str, object]:
    supervisor: Supervisor = state.supervisor
    handle = await supervisor.load(data.model)
    if data.wait:
        await supervisor.wait_ready(handle)
    return {"model": handle.config.name, "state": handle.state.value, "pid": handle.pid}


@post("/unload", status_code=200)
async def unload(state: State, data: UnloadBody) -> dict[str, object]:
    supervisor: Supervisor = state.supervisor
    was_loaded = await supervisor.unload(data.model, force=data.force, timeout=data.timeout_s)
    return {"model": data.model, "unloaded": was_loaded}


def create_admin_app(state: State) -> Litestar:
    return Litestar(
        route_handlers=[ps, load, unload],
        state=state,
        exception_handlers={Exception: _error},
    )
