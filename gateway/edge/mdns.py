"""mDNS/Bonjour: advertise the gateway on the LAN (server.mdns) as _http._tcp and
_mlx-gateway._tcp, with TXT records telling clients where the API is and how to reach it."""

from __future__ import annotations

import logging
import socket

import psutil
from zeroconf import ServiceInfo
from zeroconf.asyncio import AsyncZeroconf

from shared.addresses import is_loopback
from shared.config import ServerConfig
from shared.version import project_version

log = logging.getLogger("gateway.edge.mdns")

SERVICE_TYPES = ("_http._tcp.local.", "_mlx-gateway._tcp.local.")
WILDCARDS = ("0.0.0.0", "::", "")


def lan_addresses(host: str) -> list[str]:
    """The addresses to announce: the bind address, or every non-loopback one for a wildcard."""
    if host not in WILDCARDS:
        return [host]
    found = []
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family in (socket.AF_INET, socket.AF_INET6) and not is_loopback(
                addr.address.split("%")[0]
            ):
                found.append(addr.address.split("%")[0])
    return found


def properties(server: ServerConfig, auth_required: bool) -> dict[str, str]:
    return {
        "path": "/v1",
        "api": "openai",
        "version": project_version(),
        "tls": "1" if server.tls_cert else "0",
        "auth": "required" if auth_required else "none",
    }


def service_infos(server: ServerConfig, auth_required: bool) -> list[ServiceInfo]:
    hostname = socket.gethostname().split(".")[0]
    name = server.mdns_name or f"mlx-gateway on {hostname}"
    return [
        ServiceInfo(
            kind,
            f"{name}.{kind}",
            port=server.port,
            properties=properties(server, auth_required),
            server=f"{hostname}.local.",
            parsed_addresses=lan_addresses(server.host),
        )
        for kind in SERVICE_TYPES
    ]


class Advertiser:
    """Registers the services on start and unregisters them on close."""

    def __init__(self, infos: list[ServiceInfo]) -> None:
        self.infos = infos
        self.zeroconf: AsyncZeroconf | None = None

    async def start(self) -> None:
        self.zeroconf = AsyncZeroconf()
        for info in self.infos:
            await self.zeroconf.async_register_service(info)
        log.info("mDNS: advertising %s", ", ".join(info.name for info in self.infos))

    async def close(self) -> None:
        if self.zeroconf is None:
            return
        await self.zeroconf.async_unregister_all_services()
        await self.zeroconf.async_close()
        self.zeroconf = None


async def advertise(server: ServerConfig, auth_required: bool) -> Advertiser | None:
    """Start advertising when server.mdns is on; never fatal (the LAN may lack multicast)."""
    if not server.mdns:
        return None
    if is_loopback(server.host):
        log.info("mDNS: the gateway listens on loopback (%s); not advertising", server.host)
        return None
    advertiser = Advertiser(service_infos(server, auth_required))
    try:
        await advertiser.start()
    except Exception as exc:  # a missing multicast route must not stop the gateway
        log.warning("mDNS: advertising failed: %s", exc)
        await advertiser.close()
        return None
    return advertiser
