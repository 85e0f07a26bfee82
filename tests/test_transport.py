"""The gateway's PULL reader over real ZeroMQ ipc sockets: every frame of a burst larger
than one drain batch arrives, in order, and an undecodable frame is skipped."""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq

from gateway.workers.transport import DRAIN_BATCH, Transport
from shared.protocol import Codec, FromWorker, Heartbeat, WorkerState


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
