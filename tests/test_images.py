"""gateway/api/images.py: a request's images fetched from a local HTTP server (and refused
there by default: loopback), data images checked with Pillow, each failure a 400 naming
the part. No worker: resolve_images on canonical requests."""

from __future__ import annotations

import asyncio
import io
import ipaddress
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from PIL import Image

from gateway.api import images
from gateway.api.images import ImageLimits, is_public, resolve_images
from gateway.errors import GatewayError
from shared.types import (
    CanonicalRequest,
    ContentPart,
    ErrorCode,
    ImagePart,
    Message,
    TextPart,
)

WHERE = "messages[0].content[1].image_url.url"
OPEN = ImageLimits(fetch_private=True)  # the local server is on 127.0.0.1


def png(size: tuple[int, int] = (4, 3)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, "red").save(out, "PNG")
    return out.getvalue()


PNG = png()


@dataclass
class Server:
    base: str
    release: asyncio.Event  # the slow route answers once it is set (never, in its test)
    hosts: list[str] = field(default_factory=list)  # Host headers seen
    paths: list[str] = field(default_factory=list)
    pair: list[asyncio.Event] = field(default_factory=list)


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    state = Server("", asyncio.Event())
    both = asyncio.Event()

    async def cat(request: web.Request) -> web.StreamResponse:
        state.hosts.append(request.host)
        return web.Response(body=PNG, content_type=request.query.get("type", "image/png"))

    async def text(_: web.Request) -> web.StreamResponse:
        return web.Response(text="not a picture")

    async def big(_: web.Request) -> web.StreamResponse:
        return web.Response(body=b"\0" * 300_000, content_type="image/png")

    async def endless(request: web.Request) -> web.StreamResponse:
        """Chunked (no length): only the count of bytes read can stop it."""
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        await response.prepare(request)
        for _ in range(1000):
            await response.write(b"\0" * 65536)
        return response

    async def slow(_: web.Request) -> web.StreamResponse:
        await state.release.wait()
        return web.Response(body=PNG, content_type="image/png")

    async def pair(_: web.Request) -> web.StreamResponse:
        """Answers once two fetches are in at the same time."""
        state.pair.append(both)
        if len(state.pair) == 2:
            both.set()
        await asyncio.wait_for(both.wait(), 5)
        return web.Response(body=PNG, content_type="image/png")

    async def redirect(request: web.Request) -> web.StreamResponse:
        hops = int(request.match_info["hops"])
        raise web.HTTPFound("/cat.png" if hops == 1 else f"/redirect/{hops - 1}")

    async def to(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(request.query["url"])

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        state.paths.append(request.path)
        response: web.StreamResponse = await handler(request)
        return response

    app = web.Application(middlewares=[record])
    app.router.add_get("/cat.png", cat)
    app.router.add_get("/text", text)
    app.router.add_get("/big", big)
    app.router.add_get("/endless", endless)
    app.router.add_get("/slow", slow)
    app.router.add_get("/pair", pair)
    app.router.add_get("/redirect/{hops}", redirect)
    app.router.add_get("/to", to)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield state
    finally:
        state.release.set()
        await runner.cleanup()


def request_of(*images: bytes | str) -> CanonicalRequest:
    """One user message: some text, then each image (bytes, or an http URL), each named as
    the OpenAI translator names it."""
    parts: list[ContentPart] = [TextPart("look")]
    for j, image in enumerate(images, 1):
        where = f"messages[0].content[{j}].image_url.url"
        if isinstance(image, bytes):
            parts.append(ImagePart(image, "image/jpeg", where=where))  # typed wrong on purpose
        else:
            parts.append(ImagePart(url=image, where=where))
    return CanonicalRequest(messages=[Message("user", "look", parts=parts)])


async def refusal(request: CanonicalRequest, limits: ImageLimits = OPEN) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        await resolve_images(request, limits)
    error = info.value
    assert error.code == ErrorCode.INVALID_REQUEST and error.status == 400
    assert error.param is not None and f"`{error.param}`" in error.message
    return error


# ---- fetching --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_url_is_fetched_checked_and_replaced_by_its_bytes(server: Server) -> None:
    request = request_of(f"{server.base}/cat.png?type=image/jpeg")
    resolved = await resolve_images(request, OPEN)
    assert resolved.messages[0].parts == [
        TextPart("look"),
        ImagePart(PNG, "image/png", where=WHERE),  # the type its bytes have, no URL left
    ]
    assert resolved.messages[0].content == "look"


@pytest.mark.anyio
async def test_loopback_is_refused_by_default_and_nothing_is_fetched(server: Server) -> None:
    error = await refusal(request_of(f"{server.base}/cat.png"), ImageLimits())
    assert error.param == WHERE
    assert "127.0.0.1" in error.message and "server.image_fetch_private" in error.message
    assert server.paths == []


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "limits", "why"),
    [
        ("/missing", OPEN, "HTTP 404"),
        ("/text", OPEN, "text/plain, not an image/* type"),
        ("/big", ImageLimits(max_bytes=100_000, fetch_private=True), "larger than 100000 bytes"),
        ("/endless", ImageLimits(max_bytes=100_000, fetch_private=True), "larger than 100000"),
        ("/slow", ImageLimits(fetch_timeout_s=0.2, fetch_private=True), "longer than 0.2 s"),
        ("/redirect/4", OPEN, "redirected more than 3 times"),
    ],
)
async def test_fetch_failures_name_the_part_and_say_why(
    server: Server, path: str, limits: ImageLimits, why: str
) -> None:
    error = await refusal(request_of(f"{server.base}/cat.png", f"{server.base}{path}"), limits)
    assert error.param == "messages[0].content[2].image_url.url"
    assert why in error.message


@pytest.mark.anyio
async def test_redirects_are_followed_up_to_three(server: Server) -> None:
    resolved = await resolve_images(request_of(f"{server.base}/redirect/3"), OPEN)
    assert resolved.messages[0].parts[1] == ImagePart(PNG, "image/png", where=WHERE)
    assert server.paths == ["/redirect/3", "/redirect/2", "/redirect/1", "/cat.png"]


@pytest.mark.anyio
async def test_each_hop_is_checked(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first hop's address passes (as if public here), the redirect's does not."""
    first = ipaddress.ip_address("127.0.0.1")
    monkeypatch.setattr(images, "is_public", lambda address: address == first)
    port = server.base.rsplit(":", 1)[1]
    url = f"{server.base}/to?url=http://127.0.0.2:{port}/cat.png"
    error = await refusal(request_of(url), ImageLimits())
    assert "127.0.0.2" in error.message and server.paths == ["/to"]


@pytest.mark.anyio
async def test_fetches_of_one_request_run_at_once(server: Server) -> None:
    resolved = await resolve_images(request_of(*[f"{server.base}/pair"] * 2), OPEN)
    parts = resolved.messages[0].parts
    assert [part.data for part in parts if isinstance(part, ImagePart)] == [PNG, PNG]


def _resolving(monkeypatch: pytest.MonkeyPatch, names: dict[str, list[str]]) -> None:
    """The running loop's getaddrinfo answers `names` itself (anything else as usual)."""
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo

    async def getaddrinfo(host: str, port: int, **kw: Any) -> list[Any]:
        if host not in names:
            return await real(host, port, **kw)
        families = {4: socket.AF_INET, 6: socket.AF_INET6}
        return [
            (families[ipaddress.ip_address(a).version], socket.SOCK_STREAM, 6, "", (a, port))
            for a in names[host]
        ]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)


@pytest.mark.anyio
async def test_a_host_with_any_private_address_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _resolving(monkeypatch, {"mixed.example": ["93.184.215.14", "10.0.0.7"]})
    error = await refusal(request_of("http://mixed.example/a.png"), ImageLimits())
    assert "10.0.0.7" in error.message


@pytest.mark.anyio
async def test_the_address_checked_is_the_one_connected_to(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No second lookup (DNS rebinding): the host resolves only here, and its name still
    reaches the server in the Host header."""
    _resolving(monkeypatch, {"images.example": ["127.0.0.1"]})
    port = server.base.rsplit(":", 1)[1]
    resolved = await resolve_images(request_of(f"http://images.example:{port}/cat.png"), OPEN)
    assert resolved.messages[0].parts[1] == ImagePart(PNG, "image/png", where=WHERE)
    assert server.hosts == [f"images.example:{port}"]


@pytest.mark.anyio
async def test_a_host_with_no_address_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _resolving(monkeypatch, {"void.example": []})
    error = await refusal(request_of("http://void.example/a.png"), ImageLimits())
    assert "resolves to no address" in error.message


@pytest.mark.anyio
async def test_an_unresolvable_host_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()

    async def fail(*_: Any, **__: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(loop, "getaddrinfo", fail)
    error = await refusal(request_of("https://gone.example/a.png"), ImageLimits())
    assert "cannot be resolved" in error.message


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("100.64.0.1", False),  # shared (carrier-grade NAT)
        ("127.0.0.1", False),
        ("169.254.169.254", False),  # link-local: cloud metadata
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("240.0.0.1", False),
        ("255.255.255.255", False),
        ("::1", False),
        ("::", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("ff02::1", False),
        ("ff0e::1", False),  # global multicast
        ("::ffff:127.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("2002:7f00:1::", False),  # 6to4 of 127.0.0.1
    ],
)
def test_public_addresses(address: str, public: bool) -> None:
    assert is_public(ipaddress.ip_address(address)) is public


# ---- checking ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_image_sent_as_data_is_checked_and_typed_by_its_bytes() -> None:
    request = request_of(PNG)
    resolved = await resolve_images(request, ImageLimits())
    assert resolved.messages[0].parts[1] == ImagePart(PNG, "image/png", where=WHERE)
    assert await resolve_images(CanonicalRequest(prompt="x"), ImageLimits()) == CanonicalRequest(
        prompt="x"
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"hello, world", "not a readable image (one of PNG, JPEG,"),
        (PNG[:40], "not a readable image"),
        (PNG[:50], "damaged or incomplete (Truncated File Read)"),
        (PNG[:-12] + b"\0" * 12, "damaged or incomplete (broken PNG file"),
        (png((20, 20)), "20x20: more than 300 pixels (server.image_max_pixels)"),
        (PNG * 400, "at most 2000 are taken (server.image_max_bytes)"),
    ],
)
async def test_bad_images_name_the_part(data: bytes, why: str) -> None:
    limits = ImageLimits(max_pixels=300, max_bytes=2000)
    request = request_of(PNG, data)
    error = await refusal(request, limits)
    assert error.param == "messages[0].content[2].image_url.url"
    assert why in error.message


@pytest.mark.anyio
async def test_images_per_request_are_capped() -> None:
    request = request_of(*[PNG] * 3)
    error = await refusal(request, ImageLimits(max_count=2))
    assert error.param == "messages[0].content[3].image_url.url"
    assert "3 images; at most 2" in error.message and "server.image_max_count" in error.message
    assert await resolve_images(request, ImageLimits(max_count=3))


@pytest.mark.anyio
async def test_an_image_without_where_is_named_by_messages() -> None:
    bare = CanonicalRequest(messages=[Message("user", parts=[ImagePart(b"nope")])])
    assert (await refusal(bare)).param == "messages"


@pytest.mark.anyio
async def test_a_requests_images_together_are_capped() -> None:
    request = request_of(*[PNG] * 3)
    error = await refusal(request, ImageLimits(max_total_bytes=len(PNG) * 2))
    assert error.param == "messages[0].content[3].image_url.url"
    assert "server.image_max_total_bytes" in error.message
    assert await resolve_images(request, ImageLimits(max_total_bytes=len(PNG) * 3))


@pytest.mark.anyio
async def test_fetches_share_the_requests_byte_budget_as_they_arrive(server: Server) -> None:
    """Each fetch under its own cap, together under the request's: the first past it ends
    them all, not once every body is held."""
    url = f"{server.base}/endless"
    limits = ImageLimits(max_bytes=10**8, max_total_bytes=1_000_000, fetch_private=True)
    error = await refusal(request_of(url, url, url), limits)
    assert "more than 1000000 bytes together (server.image_max_total_bytes)" in error.message


@pytest.mark.anyio
async def test_a_requests_pixels_together_are_capped_once_per_choice() -> None:
    request = request_of(*[PNG] * 3)  # 4 x 3 each
    limits = ImageLimits(max_total_pixels=36)
    assert await resolve_images(request, limits)  # 36 pixels
    with pytest.raises(GatewayError) as info:
        await resolve_images(request, limits, choices=2)  # the worker decodes them twice
    assert "once for each of its 2 choices (server.image_max_total_pixels)" in info.value.message
    assert info.value.param is not None and info.value.param.startswith("messages[0].content")
