"""OpenAI Responses API routes (/v1/responses)."""

from __future__ import annotations

from litestar import Router

from gateway.errors import GatewayError, error_response


def responses_router() -> Router:
    return Router(path="/v1", route_handlers=[], exception_handlers={GatewayError: error_response})
