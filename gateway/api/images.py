"""A chat request's images made ready for a vision model's worker, which gets bytes only:
an http(s) URL is fetched by the gateway (a deadline, a byte cap while the body streams,
image/* only, redirects followed by hand, and no private or other non-public address unless
server.image_fetch_private allows it), and every image, fetched or sent as data, is checked
with Pillow (a known format, its pixels from the header, then verify()). Run only once the
model is known to take images. Each failure is a 400 naming the image's part."""

from __future__ import annotations

import asyncio
import io
import ipaddress
import socket
from dataclasses import dataclass

import httpx
import msgspec
from PIL import Image, UnidentifiedImageError

from gateway.errors import GatewayError
from shared.config import ServerConfig
from shared.types import CanonicalRequest, ErrorCode, ImagePart

MAX_REDIRECTS = 3
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
# What Pillow may decode: the formats vision processors take, and none of its rarer
# decoders (JPEG includes a phone camera's MPO).
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_NOT_PUBLIC = "private, loopback, link-local, multicast, reserved or unspecified"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """server.image_*: what one request's images may be."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 8192 * 8192
    max_count: int = 16
    fetch_timeout_s: float = 10.0
    fetch_private: bool = False
    max_total_bytes: int = 64 * 1024 * 1024
    max_total_pixels: int = 4 * 8192 * 8192

    @classmethod
    def of(cls, server: ServerConfig) -> ImageLimits:
        return cls(
            server.image_max_bytes,
            server.image_max_pixels,
            server.image_max_count,
            server.image_fetch_timeout_s,
            server.image_fetch_private,
            server.image_max_total_bytes,
            server.image_max_total_pixels,
        )


@dataclass(slots=True)
class _Budget:
    """One request's images together, taken from as their bytes arrive and as their headers
    are read (the fetches run at once: the first past the bound ends them all)."""

    limits: ImageLimits
    choices: int  # the worker decodes each image once per choice (`n`)
    nbytes: int = 0
    pixels: int = 0

    def take_bytes(self, image: ImagePart, count: int) -> None:
        self.nbytes += count
        if self.nbytes > self.limits.max_total_bytes:
            raise refused(
                image,
                f"this request's images hold more than {self.limits.max_total_bytes} bytes "
                "together (server.image_max_total_bytes)",
            )

    def take_pixels(self, image: ImagePart, count: int) -> None:
        self.pixels += count * self.choices
        if self.pixels > self.limits.max_total_pixels:
            each = f", counted once for each of its {self.choices} choices" * (self.choices > 1)
            raise refused(
                image,
                f"this request's images hold more than {self.limits.max_total_pixels} pixels "
                f"together{each} (server.image_max_total_pixels)",
            )


def images_in(request: CanonicalRequest) -> list[ImagePart]:
    return [
        part
        for message in request.messages
        for part in message.parts
        if isinstance(part, ImagePart)
    ]


async def resolve_images(
    request: CanonicalRequest, limits: ImageLimits, choices: int = 1
) -> CanonicalRequest:
    """The request with each image's bytes fetched (its URLs fetched concurrently) and
    checked, its media type the one its bytes have, and no URL left; its images' bytes and
    pixels (times its `choices`) within the request's bounds."""
    images = images_in(request)
    if not images:
        return request
    if len(images) > limits.max_count:
        raise refused(
            images[limits.max_count],
            f"this request has {len(images)} images; at most {limits.max_count} are taken "
            "(server.image_max_count)",
        )
    made = await _all_ready(images, _Budget(limits, max(1, choices)))
    ready = iter(made)
    messages = [
        msgspec.structs.replace(
            message,
            parts=[next(ready) if isinstance(part, ImagePart) else part for part in message.parts],
        )
        if any(isinstance(part, ImagePart) for part in message.parts)
        else message
        for message in request.messages
    ]
    return msgspec.structs.replace(request, messages=messages)


def refused(image: ImagePart, why: str) -> GatewayError:
    where = image.where or "messages"
    return GatewayError(ErrorCode.INVALID_REQUEST, f"`{where}`: {why}", where)


async def _all_ready(images: list[ImagePart], budget: _Budget) -> list[ImagePart]:
    """Each image ready, all at once; the first failure cancels the rest."""
    limits = budget.limits
    if not any(image.url is not None for image in images):
        return [await _ready(None, image, budget) for image in images]
    async with httpx.AsyncClient(
        timeout=limits.fetch_timeout_s,
        follow_redirects=False,
        trust_env=False,  # no proxy: the address checked is the one connected to
        # a connection per fetch: one made for a host is never reused for another on its IP
        limits=httpx.Limits(max_keepalive_connections=0),
    ) as client:
        tasks = [asyncio.ensure_future(_ready(client, image, budget)) for image in images]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _ready(client: httpx.AsyncClient | None, image: ImagePart, budget: _Budget) -> ImagePart:
    data, limits = image.data, budget.limits
    if image.url is not None:
        assert client is not None
        data = await fetch(client, image, image.url, limits, budget)
    else:
        budget.take_bytes(image, len(data))
    media_type, pixels = await asyncio.to_thread(checked, image, data, limits)
    budget.take_pixels(image, pixels)
    return msgspec.structs.replace(image, data=data, media_type=media_type, url=None)


def checked(image: ImagePart, data: bytes, limits: ImageLimits) -> tuple[str, int]:
    """The media type and pixels of `data`, an image within the limits that Pillow reads
    and verifies (its size read from the header, before anything is decoded)."""
    if len(data) > limits.max_bytes:
        raise refused(
            image,
            f"the image is {len(data)} bytes; at most {limits.max_bytes} are taken "
            "(server.image_max_bytes)",
        )
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as opened:
            kind, (width, height) = opened.format or "", opened.size
            if width * height > limits.max_pixels:
                raise _too_many_pixels(image, f"{width}x{height}", limits)
            opened.verify()
    except GatewayError:
        raise
    except Image.DecompressionBombError:  # beyond Pillow's own limit, checked in open()
        raise _too_many_pixels(image, "too large", limits) from None
    except UnidentifiedImageError:
        raise refused(image, f"not a readable image (one of {', '.join(FORMATS)})") from None
    except Exception as exc:
        raise refused(image, f"the image is damaged or incomplete ({exc})") from None
    return Image.MIME.get(kind, f"image/{kind.lower()}"), width * height


def _too_many_pixels(image: ImagePart, size: str, limits: ImageLimits) -> GatewayError:
    return refused(
        image,
        f"the image is {size}: more than {limits.max_pixels} pixels (server.image_max_pixels)",
    )


async def fetch(
    client: httpx.AsyncClient,
    image: ImagePart,
    url: str,
    limits: ImageLimits,
    budget: _Budget | None = None,
) -> bytes:
    """The body at `url` within the limits (redirects followed and checked), or a 400;
    its bytes taken from the request's `budget` as they arrive."""
    try:
        async with asyncio.timeout(limits.fetch_timeout_s):
            return await _follow(client, image, httpx.URL(url), limits, budget)
    except (TimeoutError, httpx.TimeoutException):
        why = f"took longer than {limits.fetch_timeout_s:g} s (server.image_fetch_timeout_s)"
        raise refused(image, f"fetching {_short(url)} {why}") from None
    except httpx.HTTPError as exc:
        why = str(exc) or type(exc).__name__
        raise refused(image, f"could not fetch {_short(url)}: {why}") from None
    except httpx.InvalidURL as exc:
        raise refused(image, f"{_short(url)} is not a valid URL: {exc}") from None


async def _follow(
    client: httpx.AsyncClient,
    image: ImagePart,
    url: httpx.URL,
    limits: ImageLimits,
    budget: _Budget | None,
) -> bytes:
    for _ in range(MAX_REDIRECTS + 1):
        if url.scheme not in ("http", "https") or not url.host:
            raise refused(image, f"{_short(url)} is not an http(s) URL with a host")
        addresses = await _addresses(image, url, limits.fetch_private)
        response = await _get(client, url, addresses)
        try:
            if response.status_code in _REDIRECTS and "location" in response.headers:
                url = url.join(response.headers["location"])
                continue
            return await _body(image, url, response, limits, budget)
        finally:
            await response.aclose()
    raise refused(image, f"fetching it was redirected more than {MAX_REDIRECTS} times")


async def _addresses(image: ImagePart, url: httpx.URL, allow_private: bool) -> list[IPAddress]:
    """Every address the host resolves to: each must be public (unless allowed)."""
    port = url.port or (443 if url.scheme == "https" else 80)
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(_host(url), port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise refused(image, f"the host of {_short(url)} cannot be resolved ({exc})") from None
    addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))
    if not addresses:
        raise refused(image, f"the host of {_short(url)} resolves to no address")
    for address in addresses:
        if not allow_private and not is_public(address):
            raise refused(
                image,
                f"the host of {_short(url)} is {address}, a {_NOT_PUBLIC} address this "
                "gateway fetches no images from (server.image_fetch_private)",
            )
    return addresses


def is_public(address: IPAddress) -> bool:
    """Neither private, loopback, link-local, multicast, reserved nor unspecified (nor an
    IPv6 address that holds such an IPv4 one)."""
    if isinstance(address, ipaddress.IPv6Address):
        for inner in (address.ipv4_mapped, address.sixtofour):
            if inner is not None and not is_public(inner):
                return False
    return address.is_global and not (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )


async def _get(
    client: httpx.AsyncClient, url: httpx.URL, addresses: list[IPAddress]
) -> httpx.Response:
    """GET `url` from the addresses checked (not from a second lookup, which could answer
    otherwise): the host's name goes in the Host header and, over TLS, in SNI and the
    certificate check. Each address in turn until one connects."""
    # no compression: the byte cap must bound what is held, not what arrived
    headers = {
        "Host": url.netloc.decode("ascii"),
        "Accept": "image/*",
        "Accept-Encoding": "identity",
    }
    extensions = {"sni_hostname": _host(url)} if url.scheme == "https" else {}
    error: httpx.ConnectError | httpx.ConnectTimeout | None = None
    for address in addresses:
        request = client.build_request(
            "GET", url.copy_with(host=str(address)), headers=headers, extensions=extensions
        )
        try:
            return await client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # the next address
            error = exc
    assert error is not None
    raise error


async def _body(
    image: ImagePart,
    url: httpx.URL,
    response: httpx.Response,
    limits: ImageLimits,
    budget: _Budget | None,
) -> bytes:
    if response.status_code != 200:
        raise refused(image, f"fetching {_short(url)} got HTTP {response.status_code}")
    content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if not content_type.startswith("image/"):
        raise refused(
            image, f"{_short(url)} is {content_type or 'of no Content-Type'}, not an image/* type"
        )
    too_large = refused(
        image, f"{_short(url)} is larger than {limits.max_bytes} bytes (server.image_max_bytes)"
    )
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > limits.max_bytes:
        raise too_large
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > limits.max_bytes:
            raise too_large
        if budget is not None:
            budget.take_bytes(image, len(chunk))
    return bytes(body)


def _host(url: httpx.URL) -> str:
    """The host as DNS and TLS take it (an international name in its ASCII form)."""
    return url.raw_host.decode("ascii")


def _short(url: str | httpx.URL, limit: int = 200) -> str:
    text = str(url)
    return text if len(text) <= limit else text[: limit - 3] + "..."
