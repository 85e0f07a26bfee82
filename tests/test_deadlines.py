"""ClientDeadlines: a body not in by its deadline is a 408; a client that takes none of the
response for send_timeout_s is treated as gone (the app's receive says http.disconnect)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from litestar.exceptions import HTTPException

from gateway.edge.deadlines import ClientDeadlines

DISCONNECT = {"type": "http.disconnect"}


class Client:
    """The server's side of one connection: body parts queued for receive, sends that block
    until `reading` is set (a client that does not read)."""

    def __init__(self) -> None:
        self.parts: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.reading = asyncio.Event()
        self.sent: list[dict[str, Any]] = []
        self.receives_cancelled = 0

    async def receive(self) -> dict[str, Any]:
        try:
            return await self.parts.get()
        except asyncio.CancelledError:
            self.receives_cancelled += 1
            raise

    async def send(self, message: dict[str, Any]) -> None:
        await self.reading.wait()
        self.sent.append(message)


def body(data: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.request", "body": data, "more_body": more}


def test_a_body_in_time_passes_through_then_the_disconnect_does() -> None:
    async def main() -> list[dict[str, Any]]:
        client = Client()
        guard = ClientDeadlines(client.receive, client.send, 1.0, 1.0)
        client.parts.put_nowait(body(b"{", more=True))
        client.parts.put_nowait(body(b"}"))
        client.parts.put_nowait(DISCONNECT)
        return [await guard.receive() for _ in range(3)]

    assert asyncio.run(main()) == [body(b"{", more=True), body(b"}"), DISCONNECT]


def test_a_body_still_coming_at_its_deadline_is_a_408() -> None:
    async def main() -> None:
        client = Client()
        guard = ClientDeadlines(client.receive, client.send, 0.1, 1.0)
        client.parts.put_nowait(body(b"{", more=True))
        assert await guard.receive() == body(b"{", more=True)
        await guard.receive()  # the rest never comes

    with pytest.raises(HTTPException) as refused:
        asyncio.run(main())
    assert refused.value.status_code == 408
    assert "server.body_read_timeout_s=0.1" in str(refused.value.detail)


def test_a_client_that_reads_nothing_is_treated_as_gone() -> None:
    async def main() -> tuple[Client, list[bool]]:
        client = Client()
        guard = ClientDeadlines(client.receive, client.send, 1.0, 0.1)
        client.parts.put_nowait(body(b""))
        await guard.receive()
        listener = asyncio.ensure_future(guard.receive())  # the app waits for a disconnect
        sender = asyncio.ensure_future(guard.send({"type": "http.response.body"}))
        assert await asyncio.wait_for(listener, 5) == DISCONNECT
        sender.cancel()  # what the app does on a disconnect
        states = [guard.stalled]
        # later sends are dropped, later receives say the same
        await asyncio.wait_for(guard.send({"type": "http.response.body"}), 1)
        states.append(await guard.receive() == DISCONNECT)
        guard.close()
        return client, states

    client, states = asyncio.run(main())
    assert states == [True, True]
    assert client.sent == [] and client.receives_cancelled == 1


def test_a_slow_reader_is_not_a_stalled_one() -> None:
    """Sends that each take less than send_timeout_s, one after the other for longer than
    it: the timer is re-armed from each send's start, and the client is never dropped."""

    async def main() -> tuple[Client, bool]:
        client = Client()
        guard = ClientDeadlines(client.receive, client.send, 1.0, 0.5)
        for _ in range(8):
            sending = asyncio.ensure_future(guard.send({"type": "http.response.body"}))
            await asyncio.sleep(0.1)
            client.reading.set()
            await sending
            client.reading.clear()
        await asyncio.sleep(0.6)  # idle, not sending: no stall either
        guard.close()
        return client, guard.stalled

    client, stalled = asyncio.run(main())
    assert not stalled and len(client.sent) == 8


def test_a_listener_that_gives_up_cancels_its_receive() -> None:
    async def main() -> Client:
        client = Client()
        guard = ClientDeadlines(client.receive, client.send, 1.0, 1.0)
        client.parts.put_nowait(body(b""))
        await guard.receive()
        listener = asyncio.ensure_future(guard.receive())
        await asyncio.sleep(0.01)
        listener.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listener
        await asyncio.sleep(0)
        return client

    assert asyncio.run(main()).receives_cancelled == 1
