"""Which Host headers the gateway answers: its defence against DNS rebinding.

A web page open in the user's browser can reach a server on the user's loopback through a
name the page controls (DNS rebinding: `evil.example` first resolves to the page's own
server, then to 127.0.0.1) and read the answers as its own origin's. A gateway on loopback
with no API keys would serve that page every model and the console's recent requests. The
browser sends the page's name in the Host header, so a gateway bound to a loopback address
answers only Host headers that name this machine: `localhost`, `*.localhost`, a loopback
address, this machine's host name, unless `server.allowed_hosts` lists others. On another
address (a LAN service) clients use names and addresses the gateway cannot know, so there
is no check unless `server.allowed_hosts` lists the names to answer.

(Litestar's AllowedHostsMiddleware compares the whole header, port included, so a server
on any port but 80 or 443 would refuse every name it was given; and its refusal is not in
the protocols' error shapes.)
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from shared.addresses import address_of, host_of, is_loopback

ANY = "*"
# Names under which container runtimes reach the host's loopback (Docker Desktop, Podman):
# `.internal` is reserved, so no site can own one to rebind.
CONTAINER_HOSTS = ("host.docker.internal", "host.containers.internal")


class HostCheck:
    """`allows(header)`: whether a request with this Host header is answered.

    Always: `localhost`, `*.localhost` and loopback addresses (a page whose origin is one of
    them is served from this machine already). Besides, `allowed` (`server.allowed_hosts`:
    names, addresses, `*.suffix` for any name under a suffix, `*` for any) or, when None,
    the default for a server bound to `bind_host`: this machine's host name and the names
    containers reach it by on loopback, any name elsewhere.
    """

    def __init__(self, allowed: list[str] | None, bind_host: str) -> None:
        self.default = allowed is None
        entries = [a.strip().lower().removesuffix(".") for a in allowed or ()]
        if allowed is None:
            entries = [socket.gethostname().lower(), *CONTAINER_HOSTS]
            if not is_loopback(bind_host):
                entries.append(ANY)
        self.any = ANY in entries
        self.suffixes = (".localhost", *(e[1:] for e in entries if e.startswith("*.")))
        self.names = {"localhost"} | {
            e for e in entries if not e.startswith("*") and address_of(e) is None
        }
        self.ips = {ip for e in entries if (ip := address_of(e)) is not None}

    def allows(self, header: str | None) -> bool:
        if self.any or header is None:  # HTTP/1.0 without Host: no browser sends that
            return True
        host = host_of(header)
        if host is None:
            return False
        ip = address_of(host)
        if ip is not None:
            mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
            return ip.is_loopback or ip in self.ips or (mapped is not None and mapped.is_loopback)
        return host in self.names or host.endswith(self.suffixes)

    def allows_origin(self, origin: str) -> bool:
        """Whether a browser's Origin header names a page this gateway answers (a page of
        another origin may send it a simple POST, though it cannot read the answer). Only
        web pages' origins are judged: an extension's or an app's (chrome-extension://...)
        is no page a site can forge; "null" (a file, a sandboxed frame) is refused."""
        if self.any:
            return True
        parts = urlsplit(origin.strip())
        if parts.scheme not in ("http", "https") and origin.strip() != "null":
            return True
        return parts.hostname is not None and self.allows(parts.hostname)

    def describe(self) -> str:
        """What is answered, for the refusal's message."""
        if self.default:
            return (
                "this gateway listens on loopback and answers localhost, loopback addresses "
                "and this machine's name; add others with server.allowed_hosts"
            )
        return "this gateway answers localhost, loopback addresses and server.allowed_hosts"
