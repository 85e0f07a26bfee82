"""gateway.edge.mdns: the services advertised (built, not sent: CI may have no multicast)."""

from __future__ import annotations

import asyncio
import socket

from gateway.edge.mdns import SERVICE_TYPES, advertise, is_loopback, service_infos
from shared.config import ServerConfig


def test_service_infos_carry_type_name_port_and_txt() -> None:
    server = ServerConfig(host="192.168.1.20", port=8443, mdns=True, mdns_name="studio")
    server.tls_cert, server.tls_key = "/c.pem", "/k.pem"
    infos = service_infos(server, auth_required=True)
    assert [info.type for info in infos] == list(SERVICE_TYPES)
    for info in infos:
        assert info.name == f"studio.{info.type}"
        assert info.port == 8443
        assert info.parsed_addresses() == ["192.168.1.20"]
        assert info.server == f"{socket.gethostname().split('.')[0]}.local."
        props = {k.decode(): (v or b"").decode() for k, v in info.properties.items()}
        assert props["path"] == "/v1"
        assert props["api"] == "openai"
        assert props["tls"] == "1"
        assert props["auth"] == "required"
        assert props["version"]


def test_default_name_and_open_plain_gateway() -> None:
    server = ServerConfig(host="10.0.0.5", port=8000, mdns=True)
    info = service_infos(server, auth_required=False)[0]
    assert info.name.startswith("mlx-gateway on ")
    assert info.properties[b"tls"] == b"0"
    assert info.properties[b"auth"] == b"none"


def test_loopback_or_disabled_is_not_advertised() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0")
    assert asyncio.run(advertise(ServerConfig(mdns=True), auth_required=False)) is None
    off = ServerConfig(host="0.0.0.0", mdns=False)
    assert asyncio.run(advertise(off, auth_required=False)) is None
