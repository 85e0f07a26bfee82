"""The gateway's sockets: ROUTER for requests and control, PULL for everything workers say."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import msgspec
import zmq

from shared.protocol import UNDECODABLE, Codec, FromWorker, ToWorker


class Door(Protocol):
    """Workers reached another way (gateway/workers/remote.py: on other machines)."""

    routes: set[str]  # the ids of the workers behind it

    def send(self, worker_id: str, frame: ToWorker) -> bool: ...


log = logging.getLogger("gateway.workers.transport")

SEND_HWM = 10_000
# Workers never send on their DEALER, so nothing read from the ROUTER is ever wanted, and
# the gateway never reads it: without a bound a peer could park its receive queue's worth
# (1,000 messages, of any size) in the gateway, on every connection. A larger message ends
# that peer's connection; ZeroMQ's handshake (its routing id: 255 bytes at most) still fits.
ROUTER_MAX_INBOUND = 1024
DRAIN_BATCH = 256  # frames handled per wakeup before yielding to the event loop


def route(
    router: zmq.Socket[bytes],
    codec: Codec,
    worker_id: str,
    frame: ToWorker,
    what: str | None = "worker",
) -> bool:
    """A frame to the peer whose routing id is `worker_id`, without blocking; False when it
    is not connected or its queue is full (logged, unless `what` is None). An unencodable
    value raises."""
    try:
        router.send_multipart([worker_id.encode(), codec.encode(frame)], flags=zmq.NOBLOCK)
        return True
    except zmq.ZMQError as exc:
        if what is not None:
            log.warning("cannot send to %s %s: %s", what, worker_id, exc)
        return False


class Transport:
    def __init__(self, requests_addr: str, outputs_addr: str) -> None:
        self.requests_addr = requests_addr
        self.outputs_addr = outputs_addr
        self.codec = Codec()
        self._decoder = msgspec.msgpack.Decoder(FromWorker)
        self._on_frame: Callable[[FromWorker], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None
        self.context: zmq.Context[zmq.Socket[bytes]] | None = None
        self.router: zmq.Socket[bytes]
        self.pull: zmq.Socket[bytes]
        self.remote: Door | None = None  # workers on other machines (over TCP)

    def bind(self, on_frame: Callable[[FromWorker], None]) -> None:
        # Plain sockets: ROUTER only ever sends, without blocking; PULL is read from the
        # event loop's reader callback on its FD, every queued frame per wakeup (no Future
        # and no task switch per frame, as an awaited zmq.asyncio recv would cost). Made
        # here, not before: a context that the garbage collector finalizes with sockets
        # still open blocks in term() forever, and a transport never bound has none.
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.pull = self.context.socket(zmq.PULL)
        for addr in (self.requests_addr, self.outputs_addr):
            if addr.startswith("ipc://"):  # a stale socket file from a crashed gateway
                Path(addr.removeprefix("ipc://")).unlink(missing_ok=True)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown worker -> error, not a drop
        self.router.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.router.setsockopt(zmq.MAXMSGSIZE, ROUTER_MAX_INBOUND)
        self.router.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.requests_addr)
        self.pull.bind(self.outputs_addr)
        self._on_frame = on_frame
        self._loop = asyncio.get_running_loop()
        fd = self.pull.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        self._fd = fd
        self._loop.add_reader(fd, self._drain)
        self._loop.call_soon(self._drain)  # frames queued before the reader was added

    def send(self, worker_id: str, frame: ToWorker) -> bool:
        """Queue a frame for a worker; False when the worker is not connected."""
        remote = self.remote
        if remote is not None and worker_id in remote.routes:
            return remote.send(worker_id, frame)
        if self._fd is None:  # not bound, or closed
            return False
        return route(self.router, self.codec, worker_id, frame)

    def _drain(self) -> None:
        """The PULL socket's FD signals edges, not levels: read until it is empty (or a
        batch is done, then come back on the next loop iteration)."""
        on_frame = self._on_frame
        if on_frame is None:
            return
        for _ in range(DRAIN_BATCH):
            try:
                raw = self.pull.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed under us at shutdown
                return
            try:
                frame = self._decoder.decode(raw)
            except UNDECODABLE as exc:  # a decoder's message says where; a traceback, nothing
                log.warning(
                    "undecodable frame from a worker (%d bytes), dropped: %s", len(raw), exc
                )
                continue
            try:
                on_frame(frame)
            except Exception:
                log.exception("error handling %s", type(frame).__name__)
        assert self._loop is not None
        self._loop.call_soon(self._drain)

    async def close(self) -> None:
        if self._loop is not None and self._fd is not None:
            self._loop.remove_reader(self._fd)
            self._fd = None
        self._on_frame = None
        if self.context is not None:
            self.router.close()
            self.pull.close()
            self.context.term()
            self.context = None
