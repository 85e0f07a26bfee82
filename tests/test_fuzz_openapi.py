"""Schemathesis against the gateway's OpenAPI document (issue 24), a check independent of
tests/test_fuzz_http.py's hand-written strategies: every operation the document lists gets
requests generated from what it declares (bodies valid and not, path parameters, methods it
does not serve, media types) and sent to the real app in process, in front of scripted workers.
Each gets a 2xx or a 4xx in the protocol's error shape, never a 5xx or a hang, and the reply
is what the document says (status, media type, body schema): the document tells the truth."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.api.openapi import MULTIPART
from gateway.api.serve import JSON
from tests.scripted_workers import scripted_app

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,  # a body the document calls invalid is a 4xx
]
# A form's fields are text on the wire: a number "of the wrong type" is a valid string.
FORM_CHECKS = [check for check in CHECKS if check is not negative_data_rejection]


def without_lifespan(app: Any) -> Any:
    """The app with no lifespan (Schemathesis' client runs one; the gateway's would start a
    supervisor, an admin socket and mDNS): it answers none, as an app that has none."""

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)

    return asgi


# Parametrizing needs the document when the module is collected: the app is built then, in
# a folder of its own (no keys file in it: the gateway is open). Schemathesis' client calls
# it as http://testserver, a name a loopback gateway answers only when told to.
FOLDER = tempfile.TemporaryDirectory(prefix="fuzz-openapi-")
APP = without_lifespan(scripted_app(Path(FOLDER.name), any_name=True, allowed_hosts=["testserver"]))
schema = schemathesis.openapi.from_asgi("/schema/openapi.json", APP)


def test_the_document_declares_each_operations_body_replies_and_errors() -> None:
    """What makes the fuzzing worth running: a handler that reads its own body declares it
    (else Schemathesis sends none), and every operation its replies and its errors."""
    operations = {
        (method.upper(), path): operation
        for path, item in schema.raw_schema["paths"].items()
        for method, operation in item.items()
        if method in ("get", "post", "delete")
    }
    assert len(operations) == 22, sorted(operations)
    assert schema.raw_schema["info"]["title"] == "mlx-gateway"
    for (method, path), operation in operations.items():
        assert {"200", "4XX", "5XX"} == set(operation["responses"]), (method, path)
        takes_body = method == "POST" and not path.endswith("/cancel")
        assert ("requestBody" in operation) == takes_body, (method, path)
    assert "$ref" not in json.dumps(schema.raw_schema)  # each schema stands alone
    chat = operations["POST", "/v1/chat/completions"]["requestBody"]["content"]
    body = chat[JSON]["schema"]  # the Struct the handler decodes, as msgspec has it
    assert "messages" in body["properties"] and "model" in body["required"]
    assert body["additionalProperties"] is False  # an unknown field is a 400


def test_the_documents_examples_are_served() -> None:
    """Every JSON body declares examples (Schemathesis starts from them, so the formatters and
    event streams behind a 200 are reached), and each of them is served."""
    served = 0
    for path, item in schema.raw_schema["paths"].items():
        for method, operation in item.items():
            content = operation.get("requestBody", {}).get("content", {})
            if JSON not in content:
                continue
            assert content[JSON].get("examples"), (method, path)
            for name, example in content[JSON]["examples"].items():
                case = schema[path][method.upper()].Case(body=example["value"], media_type=JSON)
                response = case.call(timeout=10)
                assert response.status_code == 200, (method, path, name, response.text)
                served += 1
    assert served >= 19  # 10 operations


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI stays reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
def test_every_operation_gets_a_2xx_or_a_4xx_in_the_protocols_shape(case: Any) -> None:
    checks = FORM_CHECKS if case.media_type == MULTIPART else CHECKS
    response = case.call_and_validate(checks=checks, timeout=10)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()
        if case.path.startswith("/v1/messages"):
            assert error["type"] == "error" and error["error"]["message"], error
        else:
            assert error["error"]["message"] and "type" in error["error"], error
