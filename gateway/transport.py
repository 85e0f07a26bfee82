"""The gateway's sockets: ROUTER for requests and control, PULL for everything workers say."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from shared.protocol import Codec, FromWorker, ToWorker

log = logging.getLogger("gateway.transport")

SEND_HWM = 10_000


class Transport:
    def __init__(self, requests_addr: str, outputs_addr: str) -> None:
        self.requests_addr = requests_addr
        self.outputs_addr = outputs_addr
        # ROUTER only ever sends, without blocking: a plain socket. PULL is awaited.
        self.sync_context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.context = zmq.asyncio.Context()
        self.codec = Codec()
        self.router = self.sync_context.socket(zmq.ROUTER)
        self.pull = self.context.socket(zmq.PULL)
        self._reader: asyncio.Task[None] | None = None

    def bind(self, on_frame: Callable[[FromWorker], None]) -> None:
        for addr in (self.requests_addr, self.outputs_addr):
            if addr.startswith("ipc://"):  # a stale socket file from a crashed gateway
                Path(addr.removeprefix("ipc://")).unlink(missing_ok=True)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown worker -> error, not a drop
        self.router.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.router.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.requests_addr)
        self.pull.bind(self.outputs_addr)
        self._reader = asyncio.create_task(self._read(on_frame), name="transport-reader")

    def send(self, worker_id: str, frame: ToWorker) -> bool:
        """Queue a frame for a worker; False when the worker is not connected."""
        try:
            self.router.send_multipart(
                [worker_id.encode(), self.codec.encode(frame)], flags=zmq.NOBLOCK
            )
            return True
        except zmq.ZMQError as exc:
            log.warning("cannot send to worker %s: %s", worker_id, exc)
            return False

    async def _read(self, on_frame: Callable[[FromWorker], None]) -> None:
        decoder = msgspec.msgpack.Decoder(FromWorker)
        while True:
            raw = await self.pull.recv()
            try:
                frame = decoder.decode(raw)
            except msgspec.DecodeError:
                log.exception("undecodable frame from a worker")
                continue
            try:
                on_frame(frame)
            except Exception:
                log.exception("error handling %s", type(frame).__name__)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self.router.close()
        self.pull.close()
        self.context.term()
        self.sync_context.term()
