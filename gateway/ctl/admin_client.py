"""The admin API on the gateway's unix socket, as gatewayctl calls it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

# States in which a model's worker holds (or is about to read) its weights.
LOADED_STATES = frozenset({"ready", "loading", "unloading", "backoff"})


class AdminError(Exception):
    pass


def call(
    socket: Path,
    method: str,
    path: str,
    body: object = None,
    timeout: float = 600,
    params: dict[str, Any] | None = None,
) -> Any:
    if not socket.exists():
        raise AdminError(f"no gateway is running (no admin socket at {socket})")
    transport = httpx.HTTPTransport(uds=str(socket))
    with httpx.Client(transport=transport, base_url="http://gateway", timeout=timeout) as client:
        try:
            response = client.request(method, path, json=body, params=params)
        except httpx.TransportError as exc:
            raise AdminError(f"cannot reach the gateway at {socket}: {exc}") from exc
    data = response.json()
    if response.status_code >= 400:
        raise AdminError(data.get("error", response.text))
    return data


def ps_rows(socket: Path) -> list[dict[str, Any]] | None:
    """The gateway's ps rows, or None when no gateway is running."""
    try:
        rows: list[dict[str, Any]] = call(socket, "GET", "/ps", timeout=10)
    except AdminError:
        return None
    return rows
