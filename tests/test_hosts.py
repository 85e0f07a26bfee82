"""gateway/edge/hosts.py and shared/addresses.py: the Host and Origin headers a gateway
answers (DNS rebinding), alone and through the real app and middleware in process."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import GatewayApp, create_app
from gateway.edge.hosts import HostCheck
from shared.addresses import allowed_host_problem, host_of, url_host
from shared.config import Config, ConfigError, ModelConfig, ServerConfig, load_config


def test_host_of_drops_the_port_brackets_case_and_final_dot() -> None:
    assert host_of("LocalHost:8000") == "localhost"
    assert host_of("[::1]:8000") == "::1"
    assert host_of("::1") == "::1"
    assert host_of("example.com.") == "example.com"
    assert host_of(" 127.0.0.1 ") == "127.0.0.1"
    # nothing a browser sends, and nothing a name or an address is
    for odd in ("[::1]evil.example", "evil.example::x.localhost", "a b", "x:y", "", "a,b"):
        assert host_of(odd) is None, odd


def test_url_host_reaches_a_bind_address_from_this_machine() -> None:
    assert url_host("0.0.0.0") == "127.0.0.1" and url_host("::") == "[::1]"
    assert url_host("192.168.1.5") == "192.168.1.5" and url_host("fe80::1") == "[fe80::1]"
    assert url_host("mac.local") == "mac.local"


def test_on_loopback_only_this_machines_names_are_answered() -> None:
    check = HostCheck(None, "127.0.0.1")
    for host in ("localhost:8000", "127.0.0.1:8000", "127.3.4.5", "[::1]:8000", "a.localhost"):
        assert check.allows(host), host
    assert check.allows(socket.gethostname() + ":8000")
    for host in ("evil.example:8000", "evil.example", "10.0.0.1:8000", "[::2]:8000", ""):
        assert not check.allows(host), host
    assert not check.allows("localhost.evil.example")  # a suffix is not the name
    assert not check.allows("[::1]evil.example") and not check.allows("evil.example::x.localhost")
    assert check.allows("[::ffff:127.0.0.1]:8000")  # IPv4-mapped loopback
    assert check.allows("host.docker.internal:8000")  # a container reaching the host
    assert check.allows_origin("chrome-extension://abcdef")  # no page a site can forge
    assert check.allows(None)  # no Host header: no browser sends that
    assert check.allows_origin("http://127.0.0.1:8000")
    assert check.allows_origin("http://[::1]:8000")
    assert not check.allows_origin("https://evil.example")
    assert not check.allows_origin("null")  # a file:// page or a sandboxed frame


def test_other_bind_addresses_answer_any_name_unless_listed() -> None:
    assert HostCheck(None, "0.0.0.0").allows("anything.example:8000")
    assert HostCheck(None, "192.168.1.5").allows_origin("http://elsewhere")
    listed = HostCheck(["gw.example", "*.lan", "10.0.0.7"], "0.0.0.0")
    for host in ("gw.example:8000", "GW.example", "mac.lan", "a.b.lan", "10.0.0.7:80"):
        assert listed.allows(host), host
    for host in ("lan", "other.example", "10.0.0.8"):
        assert not listed.allows(host), host
    assert listed.allows("localhost:8000") and listed.allows("127.0.0.1")  # always
    assert HostCheck(["*"], "127.0.0.1").allows("evil.example")


def test_allowed_hosts_entries_are_checked_at_load(tmp_path: Path) -> None:
    assert allowed_host_problem("*") is None and allowed_host_problem("*.lan") is None
    for bad in ("", "*.", "a*.lan", "http://x/", "two words", "*.10.0.0.1", "x:80"):
        assert allowed_host_problem(bad) is not None, bad
    path = tmp_path / "c.toml"
    path.write_text('[server]\nallowed_hosts = ["mac.lan", "*.home"]\n')
    assert load_config(path).server.allowed_hosts == ["mac.lan", "*.home"]
    path.write_text('[server]\nallowed_hosts = ["*bad.lan"]\n')
    with pytest.raises(ConfigError, match=r"server\.allowed_hosts: '\*bad\.lan'"):
        load_config(path)


def make_app(folder: Path, **server: Any) -> GatewayApp:
    settings = {"keys_file": str(folder / "keys.json"), "run_dir": str(folder), **server}
    model = ModelConfig(name="a", source="/nowhere", preload=False)
    return create_app(Config(server=ServerConfig(**settings), models=[model]))


def call(app: GatewayApp, method: str, url: str, **headers: str) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            return await client.request(method, url, headers=headers, timeout=10)

    return asyncio.run(go())


def test_a_rebound_name_gets_403_in_the_protocols_shape_on_every_path(tmp_path: Path) -> None:
    app = make_app(tmp_path)  # loopback, no keys: everything else open
    assert call(app, "GET", "http://127.0.0.1:8000/v1/models").status_code == 200
    assert call(app, "GET", "http://localhost:8000/health").status_code == 200
    r = call(app, "GET", "http://evil.example:8000/v1/models")
    assert r.status_code == 403
    error = r.json()["error"]  # OpenAI's shape
    assert "Host 'evil.example:8000' refused" in error["message"]
    assert "server.allowed_hosts" in error["message"]
    r = call(app, "GET", "http://evil.example:8000/v1/messages")
    assert r.status_code == 403 and r.json()["type"] == "error"  # Anthropic's shape
    assert r.json()["error"]["type"] == "permission_error"
    for path in ("/health", "/console", "/console/api/recent", "/metrics"):
        assert call(app, "GET", f"http://evil.example:8000{path}").status_code == 403, path


def test_two_host_headers_are_refused(tmp_path: Path) -> None:
    async def go() -> int:
        app = make_app(tmp_path)
        sent: list[dict[str, Any]] = []
        scope = {
            "type": "http",
            "method": "GET",
            "path": "/health",
            "raw_path": b"/health",
            "query_string": b"",
            "headers": [(b"host", b"localhost"), (b"host", b"evil.example")],
        }

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(scope, receive, send)
        return int(sent[0]["status"])

    assert asyncio.run(go()) == 403


def test_a_foreign_origin_is_refused_and_the_consoles_own_is_not(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    url = "http://127.0.0.1:8000/v1/models"
    assert call(app, "GET", url, origin="http://127.0.0.1:8000").status_code == 200
    r = call(app, "GET", url, origin="https://evil.example")
    assert r.status_code == 403 and "Origin 'https://evil.example' refused" in r.text


def test_a_lan_gateway_answers_its_names(tmp_path: Path) -> None:
    lan = make_app(tmp_path, host="0.0.0.0", insecure_no_auth=True)
    assert call(lan, "GET", "http://mac.example:8000/health").status_code == 200
    listed = make_app(tmp_path, host="0.0.0.0", allowed_hosts=["mac.lan"])
    assert call(listed, "GET", "http://mac.lan:8000/health").status_code == 200
    assert call(listed, "GET", "http://other.lan:8000/health").status_code == 403
