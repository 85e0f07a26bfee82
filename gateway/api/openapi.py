"""What the OpenAPI document (/schema/openapi.json) says of handlers that decode their own
bodies. Litestar documents what a handler's signature declares; ours read `request.body()`
and decode it with msgspec (a bad field is a 400 in the protocol's shape), which leaves it
nothing to document. So a handler names, through `documented(...)` as its operation_class,
the body it decodes, the replies it sends and its protocol's error body, each by media type.
A type's schema is msgspec's own JSON Schema: the document says what the decoder enforces."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import msgspec
from litestar.openapi.spec import (
    Example,
    OpenAPIMediaType,
    OpenAPIResponse,
    Operation,
    Reference,
    RequestBody,
    Schema,
)

from gateway.api.serve import JSON

SSE = "text/event-stream"
MULTIPART = "multipart/form-data"

# Media type -> what its body is: a type (its msgspec schema), a JSON Schema as it stands, or
# None (not described: an event stream, audio bytes).
Content = Mapping[str, Any]


def schema_of(type_: Any) -> dict[str, Any]:
    """msgspec's JSON Schema for a type with its definitions inlined, so that it stands alone
    in an operation (Litestar writes the document's components itself; no body type of ours
    is recursive)."""
    schema = msgspec.json.schema(type_)
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, list):
            return [inline(item) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        rest = {key: inline(value) for key, value in node.items() if key != "$ref"}
        return {**inline(defs[ref.rsplit("/", 1)[1]]), **rest} if ref else rest

    return cast(dict[str, Any], inline(schema))


def _content(
    content: Content, examples: Mapping[str, Any] | None = None
) -> dict[str, OpenAPIMediaType]:
    media: dict[str, OpenAPIMediaType] = {}
    shown: dict[str, Example | Reference] | None = None
    if examples:
        shown = {name: Example(value=value) for name, value in examples.items()}
    for media_type, what in content.items():
        schema = what if isinstance(what, dict) or what is None else schema_of(what)
        # Litestar writes a plain dict into the document as it stands
        media[media_type] = OpenAPIMediaType(schema=cast(Schema | None, schema), examples=shown)
    return media


def documented(
    error: type,
    body: Content | None = None,
    replies: Content | None = None,
    examples: Mapping[str, Any] | None = None,
) -> type[Operation]:
    """An operation class for a handler: `body` its request's content, with `examples` of it
    by name (bodies it serves: Schemathesis sends them too), `replies` its 200's, `error` the
    body of its errors (every 4xx and 5xx: the middleware's 401 and 429, a field's 400, a
    404, a worker's 503; never Litestar's own validation shape)."""
    request_body = None if body is None else RequestBody(_content(body, examples), required=True)
    ok = None if replies is None else OpenAPIResponse("the reply", content=_content(replies))
    failed = OpenAPIResponse("an error, in the protocol's shape", content=_content({JSON: error}))

    @dataclass
    class Documented(Operation):
        def __post_init__(self) -> None:
            self.request_body = request_body or self.request_body
            kept = (self.responses or {}).items()
            responses = {code: r for code, r in kept if not code.startswith(("4", "5"))}
            if ok is not None:
                responses["200"] = ok
            responses["4XX"] = responses["5XX"] = failed
            self.responses = responses

    return Documented
