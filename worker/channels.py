"""All of a worker's sockets, built in one place. Workers dial in to the gateway."""

from __future__ import annotations

from dataclasses import dataclass

import zmq

SEND_HWM = 10_000  # bounded: a wedged gateway blocks the output thread, not memory


@dataclass(frozen=True, slots=True)
class WorkerChannels:
    context: zmq.Context[zmq.Socket[bytes]]
    requests: zmq.Socket[bytes]  # DEALER, identity = worker id; owned by the input thread
    outputs: zmq.Socket[bytes]  # PUSH; owned by the output thread (heartbeats, replies)
    steps: zmq.Socket[bytes]  # PUSH; owned by the engine thread (StepOutputs, no thread hop)

    @classmethod
    def connect(cls, worker_id: str, requests_addr: str, outputs_addr: str) -> WorkerChannels:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        requests = context.socket(zmq.DEALER)
        requests.setsockopt(zmq.IDENTITY, worker_id.encode())
        requests.setsockopt(zmq.LINGER, 0)
        requests.connect(requests_addr)
        outputs, steps = context.socket(zmq.PUSH), context.socket(zmq.PUSH)
        for sock in (outputs, steps):
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, 2000)  # let the last frames (WorkerDead) go out
            sock.connect(outputs_addr)
        return cls(context, requests, outputs, steps)

    def close(self) -> None:
        self.requests.close()
        self.outputs.close()
        self.steps.close()
        self.context.term()
