"""How a sharded model's ranks find each other: the variables MLX's ring backend reads (the
ones mlx.launch sets), set by the gateway's supervisor for each rank it starts."""

from __future__ import annotations

import json
import os

RANK_ENV = "MLX_RANK"  # this process's rank in the group
HOSTFILE_ENV = "MLX_HOSTFILE"  # a JSON file: one list of "ip:port" per rank, each its own


def rank_of(env: dict[str, str] | None = None) -> int:
    return int((os.environ if env is None else env).get(RANK_ENV, "0"))


def hostfile(ports: list[int], host: str = "127.0.0.1") -> str:
    """The ring backend's host file for ranks on `host`, rank r listening on ports[r]."""
    return json.dumps([[f"{host}:{port}"] for port in ports])
