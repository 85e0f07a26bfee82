"""A TCP relay on loopback whose connections the test can cut: what a network blip does to
a worker on another machine (its connections drop, frames in flight on them are lost, and
ZeroMQ dials again through the relay)."""

from __future__ import annotations

import selectors
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress


class TcpRelay:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted = 0  # connections relayed so far
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # asked of the relay thread: (done, how many it cut, which connections: None = all)
        self._cuts: list[tuple[threading.Event, list[int], slice | None]] = []
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.listener, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                cuts, self._cuts = self._cuts, []
            for done, count, which in cuts:
                count.append(self._cut_now(which))
                done.set()
            for key, _ in self._selector.select(0.05):
                if key.data is None:
                    self._accept()
                else:
                    self._pump(key.fileobj, key.data)  # type: ignore[arg-type]

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        with self._lock:
            self._pairs.append((client, upstream))
            self.accepted += 1
        self._selector.register(client, selectors.EVENT_READ, upstream)
        self._selector.register(upstream, selectors.EVENT_READ, client)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            data = source.recv(65536)
            if data:
                sink.sendall(data)
                return
        except OSError:
            pass
        self._close(source, sink)

    def _close(self, *socks: socket.socket) -> None:
        with self._lock:
            self._pairs = [p for p in self._pairs if p[0] not in socks and p[1] not in socks]
        for sock in socks:
            with suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            sock.close()

    def _cut_now(self, which: slice | None = None) -> int:
        with self._lock:
            pairs = self._pairs[which] if which is not None else list(self._pairs)
        for client, upstream in pairs:
            for sock in (client, upstream):
                # a reset, not a clean close: what a dropped link looks like
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self._close(client, upstream)
        return len(pairs)

    def cut(self, which: slice | None = None) -> int:
        """Ends the relayed connections (`which`: those of that slice, in the order they
        were accepted; both sides see a reset); returns how many. The relay thread does it
        (it owns the sockets), before its next read."""
        done: threading.Event = threading.Event()
        count: list[int] = []
        with self._lock:
            self._cuts.append((done, count, which))
        if not done.wait(10):
            raise RuntimeError("the relay did not cut its connections")
        return count[0]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._cut_now()
        self.listener.close()


@contextmanager
def relay_to(address: str) -> Iterator[TcpRelay]:
    host, port = address.rsplit(":", 1)
    relay = TcpRelay((host, int(port)))
    try:
        yield relay
    finally:
        relay.stop()
