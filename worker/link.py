"""A remote worker's link to its gateway: waiting for the CURVE handshake before loading the
model, and leaving at once, saying why, when the gateway refuses this worker's key.

The gateway refuses an unknown key during the handshake, and ZeroMQ does not dial again
after that: the worker exits with REFUSED_KEY (`gatewayctl worker` tries again a while
later, so a key allowed meanwhile gets in). A Refuse frame (another model, other weights,
another protocol) ends it with REFUSED. A failed handshake of another kind (a wrong gateway
key) is logged, and ZeroMQ dials again.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("worker.link")

REFUSED_KEY = 77  # exit status: the gateway does not allow this worker's key
REFUSED = 78  # exit status: the gateway refused this worker (the log says why)
WAIT_LOG_S = 30.0


def leave(code: int, message: str) -> None:
    """Exit now, from any thread, with `message` in the log."""
    log.error(message)
    logging.shutdown()
    os._exit(code)


class LinkWatch:
    def __init__(self, events: zmq.Socket[bytes], endpoint: str, public_key: str) -> None:
        self.events = events
        self.endpoint = endpoint
        self.public_key = public_key
        self.connected = threading.Event()
        self.stopping = threading.Event()
        self._warned = -WAIT_LOG_S
        self.thread = threading.Thread(target=self._run, name="link", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def wait_connected(self) -> None:
        """Until the first handshake with the gateway succeeds (a refusal exits)."""
        while not self.connected.wait(WAIT_LOG_S):
            log.warning("waiting for the gateway at %s", self.endpoint)
        log.info("connected to the gateway at %s", self.endpoint)

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                if not self.events.poll(200):
                    continue
                event = recv_monitor_message(self.events)
            except zmq.ZMQError:
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected.set()
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                leave(
                    REFUSED_KEY,
                    f"the gateway at {self.endpoint} refused this worker's key; on the "
                    f"gateway's machine: gatewayctl workers add NAME {self.public_key}",
                )
            elif time.monotonic() - self._warned >= WAIT_LOG_S:
                # a wrong gateway key, or no CURVE peer there; ZeroMQ dials again
                self._warned = time.monotonic()
                log.warning(
                    "the handshake with %s failed: is the gateway key right "
                    "(`gatewayctl workers key` on the gateway's machine)?",
                    self.endpoint,
                )
