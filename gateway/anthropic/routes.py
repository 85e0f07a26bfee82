"""Anthropic Messages API routes (/v1/messages, /v1/messages/count_tokens)."""

from __future__ import annotations

from litestar import Router

from gateway.errors import GatewayError, error_response


def anthropic_router() -> Router:
    return Router(path="/v1", route_handlers=[], exception_handlers={GatewayError: error_response})
