"""Network addresses: which bind addresses serve only this machine, ZeroMQ's TCP endpoints,
and the host names of Host headers and of `server.allowed_hosts`."""

from __future__ import annotations

import ipaddress
import re

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def address_of(text: str) -> Address | None:
    """The IP address `text` spells, or None (a name, or nothing valid)."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """Whether a bind address only serves this machine."""
    if host == "localhost":
        return True
    address = address_of(host)
    return address is not None and address.is_loopback


def url_host(host: str) -> str:
    """A bind address as the host part of a URL that reaches it from this machine: a
    wildcard bind as loopback, an IPv6 address in brackets."""
    address = address_of(host)
    if address is None:
        return host
    if address.is_unspecified:
        host = "127.0.0.1" if address.version == 4 else "::1"
    return f"[{host}]" if address.version == 6 else host


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
    return text if address_of(text) is not None or NAME.fullmatch(text) else None


def allowed_host_problem(entry: str) -> str | None:
    """Why an entry of server.allowed_hosts is not one (None: it is): a name, an address,
    `*.suffix` or `*`."""
    if entry == "*":
        return None
    name = entry.strip().lower().removeprefix("*.").removesuffix(".")
    if address_of(name) is not None:
        return None if not entry.startswith("*.") else f"{entry!r}: '*.' goes before names"
    if NAME.fullmatch(name):
        return None
    return f"{entry!r} is not a host name, an address, '*.suffix' or '*'"
