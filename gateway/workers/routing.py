"""Routing a request to one of its model's replicas (the local worker and workers on other
machines): the least outstanding work first, and a conversation kept on the replica that
holds its prefix cache.

A conversation is known by its affinity key: the client's `user` field when it sends one,
else a digest of the prompt's first block (the system message and the first user turn, or
a completion prompt's start), which stays the same turn after turn as the history grows
behind it. The key sticks to the replica that served it last, while that replica has a free
place in its running batch; a busy or lost one gives way to the least loaded, which the key
sticks to from then on. Pure: no sockets, no clock.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import msgspec

from gateway.workers.slots import WorkerHandle
from shared.types import CanonicalRequest

FIRST_BLOCK_CHARS = 2048  # of the prompt's start that names a conversation
STICKY_MAX = 10_000  # conversations remembered (least recently routed dropped first)


def first_block(request: CanonicalRequest) -> str | None:
    """A digest of the prompt's first block; None when it has none worth sticking to."""
    if request.messages:
        head = []
        for message in request.messages:
            head.append((message.role, message.content[:FIRST_BLOCK_CHARS]))
            if message.role == "user":
                break
        data = msgspec.msgpack.encode(head)
    elif request.prompt:
        data = request.prompt[:FIRST_BLOCK_CHARS].encode()
    elif request.prompt_token_ids:
        data = msgspec.msgpack.encode(request.prompt_token_ids[: FIRST_BLOCK_CHARS // 4])
    else:
        return None
    return "prompt:" + hashlib.blake2b(data, digest_size=12).hexdigest()


def load(handle: WorkerHandle) -> float:
    """Its outstanding requests per place in its running batch."""
    running = handle.capacity.max_running if handle.capacity is not None else 1
    return len(handle.streams) / max(1, running)


def has_room(handle: WorkerHandle) -> bool:
    running = handle.capacity.max_running if handle.capacity is not None else 1
    return len(handle.streams) < running


class Router:
    def __init__(self, remember: int = STICKY_MAX) -> None:
        self.remember = remember
        self._sticky: OrderedDict[str, str] = OrderedDict()  # key -> worker id
        self._turn = 0  # breaks ties between equally loaded replicas in turn

    def choose(self, replicas: Sequence[WorkerHandle], key: str | None) -> WorkerHandle:
        """The replica for a request with affinity `key` (`replicas`: ready, not empty)."""
        if len(replicas) == 1:
            chosen = replicas[0]
        else:
            chosen = self._sticking(replicas, key) or self._least_loaded(replicas)
        if key is not None and len(replicas) > 1:
            self._sticky[key] = chosen.worker_id
            self._sticky.move_to_end(key)
            while len(self._sticky) > self.remember:
                self._sticky.popitem(last=False)
        return chosen

    def _sticking(self, replicas: Sequence[WorkerHandle], key: str | None) -> WorkerHandle | None:
        if key is None:
            return None
        worker_id = self._sticky.get(key)
        for handle in replicas:
            if handle.worker_id == worker_id:
                return handle if has_room(handle) else None
        return None

    def _least_loaded(self, replicas: Sequence[WorkerHandle]) -> WorkerHandle:
        self._turn += 1
        n = len(replicas)
        order = [replicas[(self._turn + i) % n] for i in range(n)]
        return min(order, key=load)

    def forget(self, worker_id: str) -> None:
        """A replica is gone: the conversations on it go elsewhere next time."""
        for key in [k for k, w in self._sticky.items() if w == worker_id]:
            del self._sticky[key]
