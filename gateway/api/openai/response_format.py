"""OpenAI's `response_format` (chat, and legacy completions as vLLM takes it) onto the
canonical ResponseFormat: the shape is checked here, the schema itself by the worker."""

from __future__ import annotations

from gateway.api.common import check_name, invalid, unsupported
from gateway.api.openai.schemas import ResponseFormat as ResponseFormatParam
from shared.types import OutputFormat, ResponseFormat


def response_format_of(param: ResponseFormatParam | None) -> ResponseFormat | None:
    """None for plain text (asked for or not)."""
    if param is None:
        return None
    if param.json_schema is not None and param.type != "json_schema":
        raise invalid(
            "`response_format.json_schema` is only allowed with type json_schema",
            "response_format.json_schema",
        )
    if param.type == "text":
        return None
    if param.type == "json_object":
        return ResponseFormat(OutputFormat.JSON_OBJECT, param="response_format")
    if param.type != "json_schema":
        raise unsupported(
            "response_format.type", f'{param.type!r}: use "text", "json_object" or "json_schema"'
        )
    spec = param.json_schema
    if spec is None:
        raise invalid(
            "`response_format` of type json_schema needs `json_schema`",
            "response_format.json_schema",
        )
    check_name(spec.name, "response_format.json_schema.name")
    if spec.schema is None:
        raise invalid(
            "`response_format.json_schema` needs its `schema` (a JSON Schema object)",
            "response_format.json_schema.schema",
        )
    return ResponseFormat(
        OutputFormat.JSON_SCHEMA,
        schema=spec.schema,
        name=spec.name,
        strict=bool(spec.strict),
        param="response_format.json_schema.schema",
    )
