"""Admin API for gatewayctl, served on a unix socket (0600) beside the public HTTP port."""

from __future__ import annotations

import msgspec
from litestar import Litestar, Request, Response, Router, get, post
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.params import FromQuery, JSONBody

from gateway.errors import GatewayError
from gateway.workers.slots import Slot
from gateway.workers.supervisor import Supervisor
from shared.config import ConfigError, ModelConfig, parse_duration
from shared.types import ErrorCode

LOG_CHUNK = 64 * 1024


class LoadBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    wait: bool = True
    # A model that is not in the config: added to the catalog for this run.
    source: str | None = None
    aliases: list[str] = []
    ttl: float | str | None = None


class UnloadBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    force: bool = False
    timeout_s: float | None = None


class ReloadBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str


def _error(_: Request, exc: Exception) -> Response[dict[str, str]]:
    if isinstance(exc, GatewayError):
        return Response({"error": exc.message, "code": exc.code.value}, status_code=exc.status)
    if isinstance(exc, HTTPException):
        return Response({"error": str(exc.detail)}, status_code=exc.status_code)
    return Response({"error": repr(exc)}, status_code=500)


def _summary(slot: Slot) -> dict[str, object]:
    handle = slot.handle
    return {
        "model": slot.name,
        "state": slot.state.value,
        "pid": handle.pid if handle else None,
        "error": slot.error,
    }


@get("/ps")
async def ps(state: State) -> list[dict[str, object]]:
    supervisor: Supervisor = state.supervisor
    return supervisor.ps()


@get("/status")
async def status(state: State) -> dict[str, object]:
    supervisor: Supervisor = state.supervisor
    return supervisor.status()


@post("/load", status_code=200)
async def load(state: State, data: JSONBody[LoadBody]) -> dict[str, object]:
    supervisor: Supervisor = state.supervisor
    known = supervisor.catalog.slots.get(data.model)
    if known is not None and data.source not in (None, known.config.source):
        raise GatewayError(
            ErrorCode.INVALID_REQUEST,
            f"model {data.model!r} is configured with source {known.config.source!r}; "
            "`--source` only adds models that are not configured",
            "source",
        )
    if data.source is not None and known is None:
        try:
            if data.ttl is not None:
                parse_duration(data.ttl, "ttl")
            model = ModelConfig(
                name=data.model,
                source=data.source,
                aliases=data.aliases,
                preload=False,
                ttl=data.ttl,
            )
        except (TypeError, msgspec.ValidationError, ConfigError) as exc:
            raise GatewayError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        supervisor.add_model(model)
    slot = await supervisor.load(data.model, wait=data.wait)
    return _summary(slot)


@post("/unload", status_code=200)
async def unload(state: State, data: JSONBody[UnloadBody]) -> dict[str, object]:
    supervisor: Supervisor = state.supervisor
    was_loaded = await supervisor.unload(data.model, force=data.force, timeout=data.timeout_s)
    return {"model": data.model, "unloaded": was_loaded}


@post("/reload", status_code=200)
async def reload(state: State, data: JSONBody[ReloadBody]) -> dict[str, object]:
    supervisor: Supervisor = state.supervisor
    handle = await supervisor.reload(data.model)
    return {"model": handle.config.name, "pid": handle.pid, "state": "ready"}


@get("/logs")
async def logs(
    state: State, model: FromQuery[str], offset: FromQuery[int] = -LOG_CHUNK
) -> dict[str, object]:
    """The worker's own log from byte `offset` (negative: from the end); follow with the
    returned offset."""
    supervisor: Supervisor = state.supervisor
    name = supervisor.resolve(model).name
    path = supervisor.run_dir.worker_log(name)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            start = max(0, size + offset) if offset < 0 else min(offset, size)
            f.seek(start)
            data = f.read(LOG_CHUNK)
    except FileNotFoundError:
        return {"model": name, "text": "", "offset": 0}
    return {"model": name, "text": data.decode("utf-8", "replace"), "offset": start + len(data)}


def create_admin_app(state: State) -> Litestar:
    return Litestar(
        route_handlers=[ps, status, load, unload, reload, logs],
        state=state,
        exception_handlers={Exception: _error},
        logging_config=None,  # the process's logging is configured once (gateway/edge/logs.py)
    )


def admin_router() -> Router:
    """The same admin API over HTTP at /admin (server.admin_http; admin-scope keys only)."""
    return Router(
        path="/admin",
        route_handlers=[ps, status, load, unload, reload, logs],
        exception_handlers={Exception: _error},
    )
