"""All of a worker's sockets, built in one place. Workers dial in to the gateway."""

from __future__ import annotations

from dataclasses import dataclass

import zmq

SEND_HWM = 10_000  # bounded: a wedged gateway blocks the output thread, not memory


@dataclass(frozen=True, slots=True)
class WorkerChannels:
    context: zmq.Context[zmq.Socket[bytes]]
    requests: zmq.Socket[bytes]  # DEALER, identity = worker id; owned by the input thread
    outputs: zmq.Socket[bytes]  # PUSH; owned by the output thread

    @classmethod
    def connect(cls, worker_id: str, requests_addr: str, outputs_addr: str) -> WorkerChannels:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        requests = context.socket(zmq.DEALER)
        requests.setsockopt(zmq.IDENTITY, worker_id.encode())
        requests.setsockopt(zmq.LINGER, 0)
        requests.connect(requests_addr)
        outputs = context.socket(zmq.PUSH)
        outputs.setsockopt(zmq.SNDHWM, SEND_HWM)
        outputs.setsockopt(zmq.LINGER, 2000)  # let the last frames (WorkerDead) go out
        outputs.connect(outputs_addr)
        return cls(context, requests, outputs)

    def close(self) -> None:
        self.requests.close()
        self.outputs.close()
        self.context.term()
