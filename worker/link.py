"""A remote worker's link to its gateway: waiting for the CURVE handshake before loading the
model, leaving at once, saying why, when the gateway refuses this worker's key, and noticing
when one of its connections drops.

The gateway refuses an unknown key during the handshake, and ZeroMQ does not dial again
after that: the worker exits with REFUSED_KEY (`gatewayctl worker` tries again a while
later, so a key allowed meanwhile gets in). A Refuse frame (another model, other weights,
another protocol) ends it with REFUSED. A failed handshake of another kind (a wrong gateway
key) is logged, and ZeroMQ dials again.

ZeroMQ dials a dropped connection again by itself, but the frames that were in flight on it
(requests to the worker, tokens from it) are gone without a word. So a drop of any of the
worker's three connections once it has joined sets `dropped`: the worker then gives up
what it was running and joins again (Hello, Ready), and the gateway, seeing a Hello from a
worker it knew, ends that worker's started requests with one error and sends the others
elsewhere: a request is never left waiting for a frame that was lost.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("worker.link")

REFUSED_KEY = 77  # exit status: the gateway does not allow this worker's key
REJOIN_COALESCE_S = 1.0  # reasons to join again that come together are answered once
REFUSED = 78  # exit status: the gateway refused this worker (the log says why)
WAIT_LOG_S = 30.0


def leave(code: int, message: str) -> None:
    """Exit now, from any thread, with `message` in the log."""
    log.error(message)
    logging.shutdown()
    os._exit(code)


@dataclass(frozen=True, slots=True)
class Rejoined:
    """To the engine thread: the worker said Hello again, starting this session."""

    session: int


class Joins:
    """A remote worker's sessions, counted by its input thread: each Hello after the first
    starts one (the gateway keeps the requests of one session apart from the next's). Each
    session's step outputs are numbered from 1, the engine's and the input thread's
    (refusals) apart: a gap tells the gateway that some were lost on the way."""

    def __init__(self) -> None:
        self.said = 0  # the session of the last Hello
        self.seq = 0  # the input thread's step outputs this session
        self._at = -REJOIN_COALESCE_S

    def due(self) -> bool:
        """Whether a session may start now (one started just now answers the same event)."""
        return time.monotonic() - self._at >= REJOIN_COALESCE_S

    def again(self, why: str) -> int | None:
        """The new session, or None if one started just now (the same event, twice)."""
        if not self.due():
            return None
        self._at = time.monotonic()
        log.warning("this worker joins the gateway again (%s)", why)
        self.said, self.seq = self.said + 1, 0
        return self.said


class LinkWatch:
    def __init__(
        self,
        events: zmq.Socket[bytes],
        endpoint: str,
        public_key: str,
        drops: tuple[zmq.Socket[bytes], ...] = (),
    ) -> None:
        self.events = events
        self.drops = drops
        self.endpoint = endpoint
        self.public_key = public_key
        self.connected = threading.Event()
        self.dropped = threading.Event()  # a connection dropped since the worker last joined
        self._down: set[int] = set()  # its sockets (0: requests) dropped and not back yet
        self._lock = threading.Lock()
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
        poller = zmq.Poller()
        for sock in (self.events, *self.drops):
            poller.register(sock, zmq.POLLIN)
        while not self.stopping.is_set():
            try:
                ready = dict(poller.poll(200))
            except zmq.ZMQError:
                return
            for index, sock in enumerate((self.events, *self.drops)):
                if sock not in ready:
                    continue
                try:
                    event = recv_monitor_message(sock)
                except zmq.ZMQError:
                    return
                self._on(index, event["event"])

    @property
    def whole(self) -> bool:
        """Every connection up: one join then answers every drop of the same outage."""
        with self._lock:
            return not self._down

    def joining(self) -> None:
        """The worker is about to say Hello (for a drop, or because the gateway asked): that
        join answers every drop seen so far, and they must not make another (the gateway
        would end what the new session had started). What a drop loses was sent before it;
        what the new session sends on a connection still down waits for it in ZeroMQ's
        queue. A drop seen after this makes the next join."""
        self.dropped.clear()

    def _on(self, index: int, kind: int) -> None:
        if kind == zmq.EVENT_DISCONNECTED:
            with self._lock:
                self._down.add(index)
            if self.connected.is_set() and not self.dropped.is_set():
                log.warning(
                    "a connection to the gateway at %s dropped: frames in flight on it are "
                    "lost, so this worker drops its requests and joins again",
                    self.endpoint,
                )
                self.dropped.set()
            return
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            with self._lock:
                self._down.discard(index)
            if index == 0:
                self.connected.set()
        elif index > 0:  # the output sockets' monitors say only the two above
            return
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
