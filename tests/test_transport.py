"""The gateway's sockets over real ZeroMQ ipc: every frame of a burst larger than one drain
batch arrives, in order; an undecodable frame is skipped, one nested too deep for the
decoder too; the ROUTER, never read, refuses anything larger than a handshake."""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq

from gateway.workers.transport import DRAIN_BATCH, ROUTER_MAX_INBOUND, Transport
from shared.protocol import Abort, Codec, FromWorker, Heartbeat, WorkerState


def test_a_burst_beyond_one_drain_batch_arrives_whole_and_in_order(tmp_path: Path) -> None:
    count = 2 * DRAIN_BATCH + 17
    seen: list[int] = []

    async def main() -> None:
        transport = Transport(f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock")
        done = asyncio.Event()

        def on_frame(frame: FromWorker) -> None:
            assert isinstance(frame, Heartbeat)
            seen.append(frame.step)
            if len(seen) == count:
                done.set()

        transport.bind(on_frame)
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(transport.outputs_addr)
        codec = Codec()
        try:
            for step in range(count):  # sent without yielding: the reader meets one burst
                push.send(codec.encode(Heartbeat("w", WorkerState.READY, step, 0, 0)))
                if step == DRAIN_BATCH // 2:
                    push.send(b"\xc1 not msgpack")
            await asyncio.wait_for(done.wait(), timeout=10)
        finally:
            push.close()
            context.term()
            await transport.close()

    asyncio.run(main())
    assert seen == list(range(count))


def test_a_frame_nested_too_deep_is_dropped_and_the_reader_reads_on(tmp_path: Path) -> None:
    """msgspec raises RecursionError, not DecodeError, for msgpack nested past its limit:
    once, that escaped the reader callback and the edge-triggered PULL was never read again."""
    deep = b"\x96\xa4ctlr\xa1w\x03\xc3\x81\xa1a" + b"\x91" * 100_000 + b"\xc0\xc0"
    seen: list[int] = []

    async def main() -> None:
        transport = Transport(f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock")
        done = asyncio.Event()

        def on_frame(frame: FromWorker) -> None:
            assert isinstance(frame, Heartbeat)
            seen.append(frame.step)
            if frame.step == 2:
                done.set()

        transport.bind(on_frame)
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(transport.outputs_addr)
        codec = Codec()
        try:
            push.send(codec.encode(Heartbeat("w", WorkerState.READY, 1, 0, 0)))
            push.send(deep)
            push.send(codec.encode(Heartbeat("w", WorkerState.READY, 2, 0, 0)))
            await asyncio.wait_for(done.wait(), timeout=10)
        finally:
            push.close()
            context.term()
            await transport.close()

    asyncio.run(main())
    assert seen == [1, 2]


def test_the_router_refuses_more_than_a_handshake(tmp_path: Path) -> None:
    """Nothing that a peer sends to the ROUTER is read: a message over ROUTER_MAX_INBOUND
    ends that peer's connection instead of waiting in the gateway's memory; a worker with
    the longest routing id still connects and gets its frames."""
    worker_id = "w" * 255
    received: list[list[bytes]] = []

    async def main() -> None:
        transport = Transport(f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock")
        transport.bind(lambda frame: None)
        context = zmq.Context()
        worker, rogue = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
        worker.setsockopt(zmq.IDENTITY, worker_id.encode())
        for sock in (worker, rogue):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(transport.requests_addr)
        try:
            for _ in range(200):  # until the worker's connection is up (ROUTER_MANDATORY)
                if transport.send(worker_id, Abort(["r"])):
                    break
                await asyncio.sleep(0.01)
            assert worker.poll(5000)
            assert Codec().to_worker.decode(worker.recv()) == Abort(["r"])
            rogue.send(b"x" * (ROUTER_MAX_INBOUND + 1))
            worker.send(b"small")  # read here only to see what got through
            while transport.router.poll(500):
                received.append(transport.router.recv_multipart())
        finally:
            worker.close()
            rogue.close()
            context.term()
            await transport.close()

    asyncio.run(main())
    assert received == [[worker_id.encode(), b"small"]]
