"""The gateway's ASGI middleware: request id, authentication, per-key limits, finish hooks,
a slow client's deadlines (gateway/edge/deadlines.py).

Plain ASGI in front of Litestar, so that refusals (401, 403, 429) cost no routing and come
out in the error shape of the protocol the path belongs to (OpenAI or Anthropic), and so that
the RequestContext is finished exactly when the response's last byte has gone out, streaming
or not.

Every path answers only the Host (and browser Origin) headers that gateway/edge/hosts.py
allows: on loopback, this machine's names (DNS rebinding); elsewhere any, unless
`server.allowed_hosts` lists them.

Access by path:
- `/health`, `/ready`: open (liveness and readiness probes); so are `/`, the console's page
  and its assets (gateway/console/), which hold no data.
- `/console/api/...`: as `/v1`; model control there needs an admin-scope key (the routes).
- `/v1/...`: a key of any scope, once keys exist; a key limited to some models gets 403 for
  others (checked by the routes, which know the model).
- `/metrics`: a key of any scope unless `server.metrics_open`.
- `/admin/...` (only with `server.admin_http`): an admin-scope key, always; with no key
  configured it is not served at all.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.api.errors import error_json
from gateway.edge.context import RequestContext, client_request_id, new_request_id
from gateway.edge.deadlines import ClientDeadlines
from gateway.edge.hosts import HostCheck
from gateway.edge.keys import ApiKey, KeyStore
from gateway.edge.ratelimit import KeyLimiter
from gateway.errors import GatewayError
from shared.config import ConfigError
from shared.types import ErrorCode

log = logging.getLogger("gateway")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]

CONTEXT_KEY = "mlx_gateway.context"
# Open: the probes, and the console's page and assets (they hold no data; the page asks for
# a key and sends it with each call of its API under /console/api).
OPEN_PATHS = frozenset({"/health", "/ready", "/", "/console", "/console/"})
OPEN_PREFIXES = ("/console/assets/",)


def context_of(scope: Any) -> RequestContext | None:
    """The RequestContext the middleware put in an ASGI scope (None outside of it)."""
    ctx: RequestContext | None = scope.get(CONTEXT_KEY)
    return ctx


def authorize_model(
    ctx: RequestContext | None, model: str, canonical_of: Callable[[str], str]
) -> None:
    """Records the model (by its configured name once known: 404 for an unknown one) and
    answers 403 when the caller's key is limited to other models, listed by name or alias."""
    if ctx is not None:
        ctx.model = model
    canonical = canonical_of(model)
    if ctx is None:
        return
    ctx.model, ctx.model_known = canonical, True
    key = ctx.key
    if key is not None and not may_use(key, canonical, canonical_of):
        allowed = ", ".join(key.models)
        raise GatewayError(
            ErrorCode.FORBIDDEN,
            f"key {key.name!r} may not use model {model!r} (allowed: {allowed})",
            "model",
        )


def may_use(key: ApiKey | None, canonical: str, canonical_of: Callable[[str], str]) -> bool:
    """Whether `key` may use the model configured as `canonical` (its list names models by
    name or alias; no list: every model)."""
    if key is None or not key.models:
        return True

    def same(listed: str) -> bool:
        try:
            return canonical_of(listed) == canonical
        except GatewayError:  # a listed model that is not configured (any more)
            return False

    return any(same(listed) for listed in key.models)


class GatewayMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        keys: KeyStore,
        limiter: KeyLimiter,
        finish_hooks: list[Callable[[RequestContext], None]],
        *,
        metrics_open: bool = False,
        body_timeout_s: float = 60.0,
        send_timeout_s: float = 60.0,
        hosts: HostCheck | None = None,
    ) -> None:
        self.app = app
        self.hosts = hosts or HostCheck(["*"], "")
        self.keys = keys
        self.limiter = limiter
        self.finish_hooks = finish_hooks
        self.metrics_open = metrics_open
        self.body_timeout_s = body_timeout_s
        self.send_timeout_s = send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        # The path as the router reads it (repeated slashes merged), for every check here:
        # `//admin/...` is `/admin/...`
        scope["path"] = path = REPEATED_SLASHES.sub("/", scope["path"])
        ctx = RequestContext(new_request_id(), scope["method"], path)
        ctx.client_request_id = client_request_id(
            headers.get(b"x-request-id", b"").decode("latin-1") or None
        )
        scope[CONTEXT_KEY] = ctx
        extra: list[tuple[bytes, bytes]] = [(b"x-request-id", ctx.request_id.encode())]
        # Hooks run in order: the limiter's release first (added by admit), then the others.
        try:
            extra += self._admit(ctx, headers)
        except GatewayError as exc:
            ctx.on_finish.extend(self.finish_hooks)
            await _send_error(send, ctx, exc, extra + exc.headers)
            ctx.finish()
            return
        ctx.on_finish.extend(self.finish_hooks)
        deadlines = ClientDeadlines(
            receive, send, self.body_timeout_s, self.send_timeout_s, ctx.request_id
        )

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                ctx.status = message["status"]
                message["headers"] = [*message.get("headers", ()), *extra]
            await deadlines.send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                ctx.finish()

        try:
            await self.app(scope, deadlines.receive, send_with_headers)
        finally:
            deadlines.close()
            ctx.finish()  # idempotent: a disconnect or an error also ends the request

    def _admit(self, ctx: RequestContext, headers: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
        try:
            return self._check(ctx, headers)
        except ConfigError as exc:  # an unreadable key file: refuse (fail closed), say why
            log.error("%s", exc)
            raise GatewayError(ErrorCode.INTERNAL, f"authentication unavailable: {exc}") from None

    def _check(self, ctx: RequestContext, headers: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
        path = ctx.path
        host, origin = headers.get(b"host"), headers.get(b"origin")
        for what, value, allowed in (
            ("Host", host, self.hosts.allows),
            ("Origin", origin, self.hosts.allows_origin),
        ):
            if value is not None and not allowed(value.decode("latin-1")):
                shown = value.decode("latin-1")[:100]
                raise GatewayError(
                    ErrorCode.FORBIDDEN, f"{what} {shown!r} refused: {self.hosts.describe()}"
                )
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return []
        admin = path == "/admin" or path.startswith("/admin/")
        if not admin and not self.keys.auth_required:
            return []
        if path == "/metrics" and self.metrics_open:
            return []
        presented = _presented_key(headers)
        if presented is None:
            raise GatewayError(
                ErrorCode.UNAUTHORIZED,
                "missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>` "
                "(create one with `gatewayctl keys create NAME`)",
            )
        key = self.keys.verify(presented)
        if key is None:
            record = self.keys.lookup(presented)
            why = "invalid API key"
            if record is not None:
                why = f"API key {record.name!r} is " + (
                    "revoked" if record.revoked_at is not None else "expired"
                )
            raise GatewayError(ErrorCode.UNAUTHORIZED, why)
        ctx.key = key
        if admin:
            if key.scope != "admin":
                raise GatewayError(
                    ErrorCode.FORBIDDEN, f"key {key.name!r} has scope {key.scope!r}, not admin"
                )
            return []
        if path.startswith("/v1/") or path in LIMITED_OUTSIDE_V1:
            return self.limiter.admit(ctx, key)
        return []


# Model routes outside /v1 (the rerank API's other paths, and the tokenizer's, which run in
# the model's worker): limited as /v1 is
LIMITED_OUTSIDE_V1 = frozenset({"/v2/rerank", "/rerank", "/tokenize", "/detokenize"})
REPEATED_SLASHES = re.compile(r"//+")


def _headers(scope: Scope) -> dict[bytes, bytes]:
    """The request's headers by lower-case name, the last of each; several Host headers
    are joined with commas (as HTTP joins repeated fields), which no host name matches."""
    headers: dict[bytes, bytes] = {}
    for name, value in scope.get("headers", ()):
        name = name.lower()
        if name == b"host" and name in headers:
            value = headers[name] + b"," + value
        headers[name] = value
    return headers


def _presented_key(headers: dict[bytes, bytes]) -> str | None:
    auth = headers.get(b"authorization")
    if auth:
        scheme, _, token = auth.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    key = headers.get(b"x-api-key")
    if key and key.strip():
        return key.decode("latin-1").strip()
    return None


async def _send_error(
    send: Send, ctx: RequestContext, error: GatewayError, headers: list[tuple[bytes, bytes]]
) -> None:
    body = error_json(ctx.path, error)
    all_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    if error.retry_after:
        all_headers.append((b"retry-after", str(error.retry_after).encode()))
    if error.status == 401:
        all_headers.append((b"www-authenticate", b'Bearer realm="mlx-gateway"'))
    ctx.status = error.status
    await send({"type": "http.response.start", "status": error.status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})
