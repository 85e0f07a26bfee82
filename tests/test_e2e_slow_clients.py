"""Slow and rude clients through a real gateway (issue 24): slowloris connections, a client
that never reads its stream, a thousand connections opened and dropped at once. Each leaves
the gateway serving others and every engine slot free."""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import select
import socket
import struct
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.gateway_proc import GatewayProc, openai_client, running_gateway, wait_for

HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
# How long a never-reading client's stream takes to fill its socket's buffers here (about
# 2.5 s on 2 cores); from then on each send blocks
FILL_S = 4.0
# Over the longest a send of the stream that is closed at FILL_S has blocked by then (FILL_S
# less the fill, plus a request's answer and a heartbeat's lag: about 3 s here)
SEND_TIMEOUT_S = 6.0
MESSAGES = [{"role": "user", "content": "Tell me a long story."}]
# Endless (a context far beyond what a test makes: it ends only by abort), and heavy: twenty
# alternatives a token fill a client's socket buffers within seconds.
ENDLESS = {
    "model": "model",
    "messages": MESSAGES,
    "max_tokens": 500_000,
    "ignore_eos": True,
    "stream": True,
    "logprobs": True,
    "top_logprobs": 20,
}
HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
)


@pytest.fixture(scope="module")
def gw(chat_model: Path) -> Iterator[GatewayProc]:
    models = [{"name": "model", "source": str(chat_model), "engine": {"max_context": 1_000_000}}]
    server = {
        "request_timeout_s": 60.0,
        "header_read_timeout_s": HEADER_TIMEOUT_S,
        "body_read_timeout_s": BODY_TIMEOUT_S,
        "send_timeout_s": SEND_TIMEOUT_S,
    }
    with running_gateway(models, **server) as gateway:
        yield gateway


def app_process(gw: GatewayProc) -> psutil.Process:
    """The process that runs the app (Granian's worker, the child of `gatewayctl serve`);
    the model's worker is its child in turn."""
    (app,) = psutil.Process(gw.proc.pid).children()
    return app


def idle(gw: GatewayProc) -> bool:
    row = gw.ps()["model"]
    return bool(row["in_flight"] == row["running"] == row["waiting"] == 0)


def request_head(body: bytes) -> bytes:
    return HEAD + b"Content-Length: %d\r\n\r\n" % len(body)


def answered_promptly(gw: GatewayProc) -> float:
    """One ordinary request from the OpenAI SDK: its answer, and how long it took."""
    start = time.monotonic()
    with openai_client(gw, timeout=15) as client:
        reply = client.chat.completions.create(
            model="model",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=8,
            extra_body={"ignore_eos": True},  # sampled: an early end of turn is no answer here
        )
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    return time.monotonic() - start


def never_reading(gw: GatewayProc) -> socket.socket:
    """A streamed request from a client with a tiny receive buffer that reads nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", gw.port))
    body = json.dumps(ENDLESS).encode()
    sock.sendall(request_head(body) + body)
    return sock


def test_slowloris_connections_are_dropped_while_others_are_served(gw: GatewayProc) -> None:
    app = app_process(gw)
    fds = app.num_fds()
    trickling = [socket.create_connection(("127.0.0.1", gw.port)) for _ in range(4)]
    silent = socket.create_connection(("127.0.0.1", gw.port))  # connects, says nothing
    body = json.dumps({"model": "model", "messages": MESSAGES, "max_tokens": 2}).encode()
    slow_body = socket.create_connection(("127.0.0.1", gw.port))
    slow_body.sendall(request_head(body) + body[:1])  # then one byte a second
    opened = time.monotonic()
    heads = {s: HEAD for s in trickling}
    replies = {s: b"" for s in [*trickling, silent, slow_body]}
    closed: dict[socket.socket, float] = {}
    latencies: list[float] = []
    sent_body, next_byte = 1, opened + 1.0
    while len(closed) < len(replies) and time.monotonic() < opened + 30:
        for sock in trickling:  # a header line a few bytes at a time, never the end
            if sock not in closed:
                with contextlib.suppress(OSError):  # closed under us: seen below
                    if not heads[sock]:
                        heads[sock] = b"X-Slow-%d: yes\r\n" % time.monotonic_ns()
                    sock.send(heads[sock][:3])
                    heads[sock] = heads[sock][3:]
        if time.monotonic() >= next_byte and slow_body not in closed:
            with contextlib.suppress(OSError):
                slow_body.send(body[sent_body : sent_body + 1])
                sent_body, next_byte = sent_body + 1, next_byte + 1.0
        open_ = [s for s in replies if s not in closed]
        readable, _, _ = select.select(open_, [], [], 0.2)  # paces the trickle
        for sock in readable:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            replies[sock] += data
            if not data:
                closed[sock] = time.monotonic() - opened
        if len(latencies) < 3:  # meanwhile, others are served as usual
            latencies.append(answered_promptly(gw))
    for sock in replies:
        sock.close()

    assert len(closed) == len(replies), "a slow connection was never dropped"
    assert max(latencies) < 5.0, latencies
    for sock in [*trickling, silent]:  # dropped by Granian, at server.header_read_timeout_s
        assert replies[sock] == b""
        assert HEADER_TIMEOUT_S - 1.0 <= closed[sock] <= HEADER_TIMEOUT_S + 5.0
    # the body: a 408 at server.body_read_timeout_s, and the connection closed after it
    assert replies[slow_body].startswith(b"HTTP/1.1 408 ")
    assert b"server.body_read_timeout_s=3" in replies[slow_body]
    assert sent_body < len(body)
    assert BODY_TIMEOUT_S - 0.5 <= closed[slow_body] <= BODY_TIMEOUT_S + 5.0
    wait_for(lambda: app.num_fds() <= fds, what="the gateway's descriptors back")
    assert idle(gw)


def test_a_client_that_never_reads_holds_its_slot_only_until_it_goes(gw: GatewayProc) -> None:
    """Its stream fills the socket's buffers and the gateway merges what it cannot send
    (memory stays flat); others are served as usual; closing the socket frees the slot."""
    app = app_process(gw)
    rss = app.memory_info().rss
    sock = never_reading(gw)
    try:
        wait_for(lambda: gw.ps()["model"]["running"] == 1, what="the stream running")
        running = time.monotonic()
        latencies = [answered_promptly(gw)]
        while time.monotonic() - running < FILL_S and len(latencies) < 100:
            latencies.append(answered_promptly(gw))
        assert max(latencies) < 5.0, latencies
        assert gw.ps()["model"]["in_flight"] == 1  # nothing ended it: it is blocked
        assert app.memory_info().rss - rss < 64 * 2**20
    finally:
        sock.close()
    wait_for(lambda: gw.ps()["model"]["in_flight"] == 0, what="the gateway's abort")
    wait_for(lambda: idle(gw), what="the worker's slot free")


def test_a_client_that_never_reads_is_dropped_after_send_timeout_s(gw: GatewayProc) -> None:
    """Nobody closes it: once it has taken nothing for server.send_timeout_s the gateway
    treats it as gone, and the worker stops making tokens for it."""
    sock = never_reading(gw)
    try:
        wait_for(lambda: gw.ps()["model"]["running"] == 1, what="the stream running")
        wait_for(lambda: idle(gw), timeout=SEND_TIMEOUT_S + 25, what="the stalled stream ended")
        assert f"took none of the response for {SEND_TIMEOUT_S:g}s" in gw.logs()
        # What it reads now is what was sent before the stall, cut off: no end of stream.
        sock.settimeout(10)
        data, deadline = b"", time.monotonic() + 20
        while time.monotonic() < deadline:
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            data += chunk
        assert data.startswith(b"HTTP/1.1 200 ") and b"[DONE]" not in data[-200:]
    finally:
        sock.close()
    assert answered_promptly(gw) < 5.0


async def open_and_drop(port: int, n: int) -> Counter[str]:
    """n connections at once: a quarter only connect, a quarter send half a request head, a
    quarter a whole streamed request, a quarter also wait for the response's status line;
    then each goes, half of the last ones with a reset rather than a close."""
    body = json.dumps({**ENDLESS, "logprobs": False, "top_logprobs": None}).encode()
    seen: Counter[str] = Counter()
    go = asyncio.Event()

    async def one(i: int) -> None:
        await go.wait()
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
        try:
            kind = i % 4
            if kind == 1:
                writer.write(HEAD)
            elif kind >= 2:
                writer.write(request_head(body) + body)
            await writer.drain()
            if kind == 3:
                status = await asyncio.wait_for(reader.readline(), 30)
                seen[status.split(b" ")[1].decode() if status else "closed"] += 1
                if i % 8 == 7:
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        finally:
            writer.close()
        seen["done"] += 1

    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    go.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    seen.update(type(r).__name__ for r in results if isinstance(r, BaseException))
    return seen


def test_a_thousand_connections_opened_and_dropped_at_once(gw: GatewayProc) -> None:
    n = 1000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 256:
        wanted = n + 256 if hard == resource.RLIM_INFINITY else min(hard, n + 256)
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    app = app_process(gw)
    fds = app.num_fds()
    try:
        seen = asyncio.run(open_and_drop(gw.port, n))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert seen["done"] == n, seen
    # every stream that got an answer was started (200) or refused for a full queue (503)
    assert set(seen) <= {"done", "200", "503"} and seen["200"] > 0, seen
    assert answered_promptly(gw) < 5.0
    wait_for(lambda: idle(gw), what="every slot free again")
    wait_for(lambda: app.num_fds() <= fds, what="the gateway's descriptors back")
