"""The door for workers on other machines: one TCP port (server.workers_listen), a ZeroMQ
ROUTER with CURVE on it.

CURVE encrypts and authenticates both directions: a worker must know the gateway's public
key to connect at all, and the gateway lets in only the public keys added with `gatewayctl
workers add` (checked by a ZAP handler at each connection's handshake, before any message
is read: a worker with another key, or one speaking plain TCP, is refused and nothing it
sends reaches the gateway). Each message that does arrive carries the key its connection
proved (ZeroMQ's User-Id property), and the supervisor accepts a frame only from the key its
worker joined with: an allowed worker cannot speak for another.

A worker's three sockets (requests, outputs, step outputs) are DEALERs on this one ROUTER;
the gateway sends to the requests socket by its routing id, the worker id.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from gateway.workers.transport import route
from shared.addresses import tcp_endpoint
from shared.cluster import GATEWAY_KEY, AllowedWorkers, ClusterError, key_pair
from shared.config import split_address
from shared.protocol import UNDECODABLE, Abort, Codec, FromWorker, ToWorker

log = logging.getLogger("gateway.workers.remote")

SEND_HWM = 10_000
MAX_MESSAGE = 256 * 2**20  # an authenticated worker's largest frame
DRAIN_BATCH = 256
# ZeroMQ's own heartbeats on each TCP connection: a peer silent this long is disconnected
# (a half-open connection, a sleeping laptop), and the worker dials in again.
ZMQ_HEARTBEAT_IVL_MS = 2_000
ZMQ_HEARTBEAT_TIMEOUT_MS = 10_000
REFUSAL_LOG_S = 60.0  # an unknown key's refusal is logged once per minute at most

# (frame, the public key its connection proved, the peer's IP address, the routing id of
# the connection it came on)
OnRemoteFrame = Callable[[FromWorker, str, str, bytes], None]
REFUSALS_LOGGED = 10  # unknown keys' refusals logged per minute, all keys together


class Gatekeeper:
    """The ZAP handler's judgement on each connecting key (runs on the authenticator's
    thread): allowed when the allowed-workers file lists it."""

    def __init__(self, allowed: AllowedWorkers) -> None:
        self.allowed = allowed
        self._logged: dict[bytes, float] = {}

    def callback(self, domain: str, key: bytes) -> bool:
        try:  # an exception here would end the authenticator's thread: no one could join
            record = self.allowed.lookup(key.decode("ascii", "replace"))
        except Exception as exc:
            log.error("remote worker refused: cannot read the allowed workers: %s", exc)
            return False
        if record is not None:
            return True
        now = time.monotonic()
        self._logged = {k: t for k, t in self._logged.items() if now - t < REFUSAL_LOG_S}
        if key not in self._logged and len(self._logged) < REFUSALS_LOGGED:
            self._logged[key] = now
            log.warning(
                "a worker with an unknown key was refused: %s (allow it with "
                "`gatewayctl workers add NAME %s`)",
                key.decode("ascii", "replace"),
                key.decode("ascii", "replace"),
            )
        return False


class RemoteDoor:
    def __init__(self, address: str, cluster: Path) -> None:
        self.endpoint = tcp_endpoint(*split_address(address, "server.workers_listen"))
        self.cluster = cluster
        self.allowed = AllowedWorkers(cluster / "workers.json")
        self.public_key = ""
        self.routes: set[str] = set()  # worker ids reached through this door
        self.codec = Codec()
        self._decoder = msgspec.msgpack.Decoder(FromWorker)
        self._undecodable_at = -60.0  # a peer's bad frames are logged once a minute
        self._on_frame: OnRemoteFrame | None = None
        self._on_disconnect: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fds: list[int] = []
        self.context: zmq.Context[zmq.Socket[bytes]] | None = None
        self.auth: ThreadAuthenticator | None = None
        self.router: zmq.Socket[bytes]
        self.monitor: zmq.Socket[bytes]

    def bind(self, on_frame: OnRemoteFrame, on_disconnect: Callable[[], None]) -> None:
        pair = key_pair(self.cluster / GATEWAY_KEY)
        self.public_key = pair.public
        # Its own context: the ZAP handler of a context also judges its other sockets.
        self.context = zmq.Context()
        self.auth = ThreadAuthenticator(self.context, log=logging.getLogger("gateway.zap"))
        self.auth.start()
        self.auth.configure_curve_callback("*", credentials_provider=Gatekeeper(self.allowed))
        router = self.router = self.context.socket(zmq.ROUTER)
        router.curve_server = True
        router.curve_secretkey = pair.secret.encode()
        router.curve_publickey = pair.public.encode()
        # No ROUTER_HANDOVER: a routing id stays with the connection that has it until that
        # connection closes (a worker dialing in again gets it once its old one is gone), so
        # the id a Hello proved on its key cannot be taken by another connection.
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, SEND_HWM)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
        router.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
        try:
            router.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ClusterError(f"cannot listen for workers on {self.endpoint}: {exc}") from exc
        self.monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._on_frame, self._on_disconnect = on_frame, on_disconnect
        self._loop = loop = asyncio.get_running_loop()
        for sock, reader in ((router, self._drain), (self.monitor, self._disconnects)):
            fd = sock.getsockopt(zmq.FD)
            assert isinstance(fd, int)
            self._fds.append(fd)
            loop.add_reader(fd, reader)
            loop.call_soon(reader)
        log.info("listening for workers on %s (CURVE; key %s)", self.endpoint, pair.public)

    def send(self, worker_id: str, frame: ToWorker, quiet: bool = False) -> bool:
        if not self._fds:
            return False
        sent = route(self.router, self.codec, worker_id, frame, None if quiet else "remote worker")
        self._rearm()
        return sent

    def reachable(self, worker_id: str) -> bool:
        """Whether the worker's requests connection is open (a no-op Abort goes to it)."""
        if not self._fds:
            return False
        try:
            self.router.send_multipart(
                [worker_id.encode(), self.codec.encode(Abort([]))], flags=zmq.NOBLOCK
            )
            return True
        except zmq.Again:  # connected, its queue full: alive as far as this can tell
            return True
        except zmq.ZMQError:
            return False
        finally:
            self._rearm()

    def _rearm(self) -> None:
        """A send on the ROUTER may consume the edge its FD would have signalled for frames
        that arrived meanwhile: read them on the next loop turn."""
        events = self.router.getsockopt(zmq.EVENTS)
        if self._loop is not None and isinstance(events, int) and events & zmq.POLLIN:
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        on_frame = self._on_frame
        if on_frame is None:
            return
        for _ in range(DRAIN_BATCH):
            try:
                parts = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            if len(parts) != 2:
                continue
            sender, payload = parts[0].bytes, parts[1]
            key = payload.get("User-Id")
            peer = payload.get("Peer-Address")
            try:
                frame = self._decoder.decode(payload.buffer)
            except UNDECODABLE as exc:
                now = time.monotonic()
                if now - self._undecodable_at >= 60.0:
                    self._undecodable_at = now
                    log.warning(
                        "undecodable frame from remote worker %r, dropped (such frames are "
                        "logged once a minute): %.200r",
                        key,
                        str(exc),
                    )
                continue
            try:
                on_frame(frame, str(key), str(peer), sender)
            except Exception:
                log.exception("error handling %s", type(frame).__name__)
        assert self._loop is not None
        self._loop.call_soon(self._drain)

    def _disconnects(self) -> None:
        seen = False
        while True:
            try:
                self.monitor.recv_multipart(zmq.NOBLOCK)
                seen = True
            except (zmq.Again, zmq.ZMQError):
                break
        if seen and self._on_disconnect is not None:
            self._on_disconnect()

    def _close_sockets(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        if self.context is not None:
            self.context.destroy(linger=0)
            self.context = None

    def close(self) -> None:
        if self._loop is not None:
            for fd in self._fds:
                self._loop.remove_reader(fd)
        self._fds = []
        self._on_frame = self._on_disconnect = None
        if self.context is not None:
            self.router.disable_monitor()
            self.monitor.close()
            self.router.close()
        self._close_sockets()
