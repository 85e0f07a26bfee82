"""gateway/api/serve.py's InFlight: requests by id and by the client's own X-Request-Id, for
POST /v1/requests/{id}/cancel; each key names its own."""

from __future__ import annotations

import pytest

from gateway.api.serve import InFlight
from gateway.edge.context import RequestContext
from gateway.edge.keys import ApiKey
from gateway.errors import GatewayError


def ctx(request_id: str, key: ApiKey | None, client_id: str = "") -> RequestContext:
    context = RequestContext(request_id, "POST", "/v1/chat/completions", key=key)
    context.client_request_id = client_id
    return context


def key(name: str, scope: str = "inference") -> ApiKey:
    return ApiKey(name, name, "0" * 64, 0.0, scope=scope)  # type: ignore[arg-type]


def test_a_client_id_names_the_request_of_the_key_that_sent_it() -> None:
    alice, bob, ops = key("alice"), key("bob"), key("ops", "admin")
    in_flight = InFlight()
    cancelled: list[str] = []
    for rid, owner in (("r-alice", alice), ("r-bob", bob)):  # the same X-Request-Id, later bob
        in_flight.add(rid, ctx(rid, owner, "job-1"), [], lambda rid=rid: cancelled.append(rid))
    assert in_flight.cancel(None, "job-1", ctx("c1", alice)) == 1  # type: ignore[arg-type]
    assert cancelled == ["r-alice"]  # bob's later one does not hide it
    with pytest.raises(GatewayError, match="no request 'job-2'"):
        in_flight.cancel(None, "job-2", ctx("c2", alice))  # type: ignore[arg-type]
    assert in_flight.cancel(None, "job-1", ctx("c3", ops)) == 1  # type: ignore[arg-type]
    assert cancelled == ["r-alice", "r-bob"]  # an admin key: the latest of that id
    in_flight.remove("r-bob")
    with pytest.raises(GatewayError):
        in_flight.cancel(None, "job-1", ctx("c4", bob))  # type: ignore[arg-type]
    in_flight.remove("r-alice")
    assert not in_flight.client_ids and not in_flight.requests


def test_on_an_open_gateway_any_client_names_the_latest() -> None:
    in_flight = InFlight()
    cancelled: list[str] = []
    for rid in ("r1", "r2"):
        in_flight.add(rid, ctx(rid, None, "same"), [], lambda rid=rid: cancelled.append(rid))
    assert in_flight.cancel(None, "same", ctx("c", None)) == 1  # type: ignore[arg-type]
    assert cancelled == ["r2"]
