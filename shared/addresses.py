"""Network addresses: which bind addresses serve only this machine, ZeroMQ's TCP endpoints,
and the host names of Host headers and of `server.allowed_hosts`."""

from __future__ import annotations

import ipaddress
import re


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


NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")


def host_of(header: str) -> str | None:
    """The host of a Host header: no port, no IPv6 brackets, lower case, no final dot; None
    for one that is neither a host name nor an address (`[::1]x`, `a::b.c`, spaces)."""
    text = header.strip().lower()
    if text.startswith("["):  # [::1]:8000
        inside, _, rest = text[1:].partition("]")
        if rest and not re.fullmatch(r":\d+", rest):
            return None
        text = inside
    elif text.count(":") == 1:  # name:8000 (a bare IPv6 address has more colons)
        text, _, port = text.partition(":")
        if not port.isdigit():
            return None
    text = text.removesuffix(".")
    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        return text if NAME.fullmatch(text) else None


def allowed_host_problem(entry: str) -> str | None:
    """Why an entry of server.allowed_hosts is not one (None: it is): a name, an address,
    `*.suffix` or `*`."""
    if entry == "*":
        return None
    name = entry.strip().lower().removeprefix("*.").removesuffix(".")
    try:
        ipaddress.ip_address(name)
        return None if not entry.startswith("*.") else f"{entry!r}: '*.' goes before names"
    except ValueError:
        if NAME.fullmatch(name):
            return None
    return f"{entry!r} is not a host name, an address, '*.suffix' or '*'"
