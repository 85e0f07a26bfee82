"""Logging: one format for the gateway and its workers (text or JSON lines), and the access log.

`server.log_format = "json"` makes every line a JSON object (python-json-logger) with `time`,
`level`, `logger`, `message` and, where there is one, `request_id`; workers inherit the
choice through MLX_GATEWAY_LOG_FORMAT and tag their lines with the same request id, so one
`grep <id>` (or a `jq` filter) follows a request from the gateway into its worker.

The access log (logger `gateway.access`) writes one line per finished request: method, path,
status, model, key name, tokens and timings. Prompts, completions and keys never appear in
any log; `server.log_bodies` turns on DEBUG lines with request bodies, explicitly.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Callable

from pythonjsonlogger.json import JsonFormatter

from gateway.edge.context import RequestContext

LOG_FORMAT_ENV = "MLX_GATEWAY_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
_JSON_FIELDS = "%(asctime)s %(levelname)s %(name)s %(message)s"
_RENAME = {"asctime": "time", "levelname": "level", "name": "logger"}

access = logging.getLogger("gateway.access")
_PROBES = frozenset({"/health", "/ready", "/metrics"})  # polled: not worth a line each
bodies = logging.getLogger("gateway.bodies")


def formatter(fmt: str, static: dict[str, str] | None = None) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter(_JSON_FIELDS, rename_fields=_RENAME, static_fields=static or {})
    return logging.Formatter(TEXT_FORMAT)


def setup_logging(level: str, fmt: str) -> None:
    """Configure the root logger once per process; workers spawned later inherit `fmt`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    os.environ[LOG_FORMAT_ENV] = fmt


def _worker_share(ctx: RequestContext) -> dict[str, object]:
    """Where the first token's wait went in the worker (the rest of ttft_ms is the
    gateway's and the transport's)."""
    t = ctx.worker_timings
    if t is None:
        return {}
    return {
        "preprocess_ms": round(t.preprocess_s * 1000, 1),
        "queue_ms": round(t.queue_s * 1000, 1),
        "prefill_ms": round(t.prefill_s * 1000, 1),
    }


def access_hook() -> Callable[[RequestContext], None]:
    """A finish hook that writes the access line of each request."""

    def hook(ctx: RequestContext) -> None:
        if ctx.path in _PROBES or not access.isEnabledFor(logging.INFO):
            return
        ttft = ctx.ttft_s
        fields: dict[str, object] = {
            "request_id": ctx.request_id,
            "method": ctx.method,
            "path": ctx.path,
            "status": ctx.status,
            "model": ctx.model or "-",
            "key": ctx.key_name,
            "stream": ctx.stream,
            "prompt_tokens": ctx.prompt_tokens,
            "completion_tokens": ctx.completion_tokens,
            "ttft_ms": None if ttft is None else round(ttft * 1000, 1),
            **_worker_share(ctx),
            "duration_ms": round(ctx.duration_s * 1000, 1),
            "finish_reason": ctx.finish_reason or None,
            "error": ctx.error_code or None,
        }
        if ctx.client_request_id:
            fields["client_request_id"] = ctx.client_request_id
        if ctx.user:  # the request's end-user id (OpenAI's user / safety_identifier)
            fields["user"] = ctx.user
        text = " ".join(f"{k}={text_field(v)}" for k, v in fields.items())
        access.info(text, extra=fields)

    return hook


_PLAIN = re.compile(r"[^\s=\"\x00-\x1f\x7f-\x9f]*")


def text_field(value: object) -> str:
    """A field's value in a text access line: as it is where it is one word of printable
    characters, else quoted and escaped as a JSON string (a client's path, model or user
    id can hold spaces, `=` or line breaks: one request, one line, its own fields)."""
    if value is None:
        return "-"
    text = str(value)
    return text if _PLAIN.fullmatch(text) else json.dumps(text)


def log_body(enabled: bool, ctx: RequestContext | None, body: bytes) -> None:
    """Request bodies (prompts) at DEBUG, only with server.log_bodies = true."""
    if enabled and ctx is not None:
        text = body[:65536].decode("utf-8", "replace")
        bodies.debug("request body %s", text, extra={"request_id": ctx.request_id})
