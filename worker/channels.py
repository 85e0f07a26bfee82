"""All of a worker's sockets, built in one place. Workers dial in to the gateway."""

from __future__ import annotations

from dataclasses import dataclass

import zmq

SEND_HWM = 10_000  # bounded: a wedged gateway blocks the output thread, not memory
# ZeroMQ's heartbeats on a TCP link to a gateway on another machine: a gateway silent this
# long is disconnected, and dialed again (ZeroMQ reconnects by itself).
ZMQ_HEARTBEAT_IVL_MS = 2_000
ZMQ_HEARTBEAT_TIMEOUT_MS = 10_000


@dataclass(frozen=True, slots=True)
class RemoteLink:
    """How a worker on another machine reaches its gateway: the gateway's TCP endpoint and
    public key, and the worker's own CURVE key pair (Z85 text)."""

    endpoint: str  # tcp://HOST:PORT
    server_key: str
    public_key: str
    secret_key: str


@dataclass(frozen=True, slots=True)
class WorkerChannels:
    context: zmq.Context[zmq.Socket[bytes]]
    requests: zmq.Socket[bytes]  # DEALER, identity = worker id; owned by the input thread
    outputs: zmq.Socket[bytes]  # PUSH; owned by the output thread (heartbeats, replies)
    steps: zmq.Socket[bytes]  # PUSH; owned by the engine thread (StepOutputs, no thread hop)
    # a remote worker's requests socket's handshake and disconnect events (ZeroMQ's
    # monitor; link thread)
    events: zmq.Socket[bytes] | None = None
    # its output sockets' disconnect events: frames in flight on a connection that drops
    # are lost without a word (link thread)
    drops: tuple[zmq.Socket[bytes], ...] = ()

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

    @classmethod
    def dial(cls, worker_id: str, link: RemoteLink) -> WorkerChannels:
        """The same three sockets over TCP with CURVE: DEALERs on the gateway's one ROUTER
        (the requests socket's routing id is the worker id)."""
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        requests, outputs, steps = (context.socket(zmq.DEALER) for _ in range(3))
        requests.setsockopt(zmq.IDENTITY, worker_id.encode())
        requests.setsockopt(zmq.LINGER, 0)
        for sock in (outputs, steps):
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, 2000)
        for sock in (requests, outputs, steps):
            sock.curve_serverkey = link.server_key.encode()
            sock.curve_publickey = link.public_key.encode()
            sock.curve_secretkey = link.secret_key.encode()
            sock.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
        events = requests.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_DISCONNECTED
        )
        drops = tuple(
            s.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            for s in (outputs, steps)
        )
        for sock in (requests, outputs, steps):
            sock.connect(link.endpoint)
        return cls(context, requests, outputs, steps, events, drops)

    def close(self) -> None:
        if self.events is not None:
            self.requests.disable_monitor()
            self.events.close()
        for sock, monitor in zip((self.outputs, self.steps), self.drops, strict=False):
            sock.disable_monitor()
            monitor.close()
        self.requests.close()
        self.outputs.close()
        self.steps.close()
        self.context.term()
