"""Network addresses: which bind addresses serve only this machine, ZeroMQ's TCP endpoints,
and the host names of Host headers and of `server.allowed_hosts`."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether a bind address only serves this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tcp_endpoint(host: str, port: int) -> str:
    """ZeroMQ's address for HOST:PORT (an IPv6 host in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def host_of(header: str) -> str:
    """The host of a Host header: no port, no IPv6 brackets, lower case, no final dot."""
    text = header.strip().lower()
    if text.startswith("["):  # [::1]:8000
        text = text[1 : text.find("]")] if "]" in text else text[1:]
    elif text.count(":") == 1:  # name:8000 (a bare IPv6 address has more colons)
        text = text.partition(":")[0]
    return text.removesuffix(".")


def allowed_host_problem(entry: str) -> str | None:
    """Why an entry of server.allowed_hosts is not one (None: it is): a name, an address,
    `*.suffix` or `*`."""
    if entry == "*":
        return None
    name = entry.removeprefix("*.")
    if not name or "*" in name or "/" in name or any(c.isspace() for c in name):
        return f"{entry!r} is not a host name, an address, '*.suffix' or '*'"
    return None
