"""Errors met before a protocol's router has them (the middleware's 401/413/429, Litestar's own
404/405/500): rendered in the shape of the protocol that the request's path belongs to."""

from __future__ import annotations

from litestar import Request, Response

from gateway.api.anthropic import errors as anthropic
from gateway.api.openai import errors as openai
from gateway.errors import GatewayError


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_json(path: str, error: GatewayError) -> bytes:
    return (anthropic if is_anthropic_path(path) else openai).error_json(error)


def error_response(request: Request, exc: GatewayError) -> Response[bytes]:
    shape = anthropic if is_anthropic_path(request.url.path) else openai
    return shape.error_response(request, exc)
