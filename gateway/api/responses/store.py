"""The Responses API's store: stored responses in the gateway's memory, bounded.

At most `max_stored` entries (beyond that the oldest that has ended is dropped; a background
response still running only when every entry is one, and it is then cancelled), each kept
`ttl_s` after it ended (a negative TTL: until dropped). A response made with an API key is
visible only to that key and to admin-scope keys; on an open gateway (no keys) to everyone.
Anyone else sees an unknown id.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.api.responses.schemas import Item, ResponseObject
from gateway.api.responses.translate import RUNNING

if TYPE_CHECKING:
    from gateway.edge.keys import ApiKey


@dataclass(eq=False)
class StoredResponse:
    response: ResponseObject
    owner: str | None  # the id of the key that made it (None: an open gateway)
    items: list[Item]  # its input: the history it was chained onto, then its own
    expires_at: float | None = None  # set when it ends
    task: asyncio.Task[Any] | None = None  # a background response's generation
    cancel: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def id(self) -> str:
        return self.response.id

    @property
    def running(self) -> bool:
        return self.response.status in RUNNING

    def conversation(self) -> list[Item]:
        """What a response chained onto this one continues: its input, then its output
        (reasoning, messages and function calls: the next turn answers the calls)."""
        return [*self.items, *self.response.output]


def visible(entry: StoredResponse, key: ApiKey | None) -> bool:
    if key is None or key.scope == "admin":
        return True
    return entry.owner == key.id


class ResponseStore:
    def __init__(
        self, max_stored: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_stored = max_stored
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._expiry: list[tuple[float, int, str]] = []  # (expires_at, tiebreak, id)
        self._count = 0

    def __len__(self) -> int:
        self._purge()
        return len(self._entries)

    def add(self, entry: StoredResponse) -> list[StoredResponse]:
        """Keep `entry` (the newest); returns those dropped to stay within the bound."""
        self._purge()
        self._entries[entry.id] = entry
        over = len(self._entries) - self.max_stored
        if over <= 0:
            return []
        # the oldest that ended first: one tenant's traffic must not end another's job
        ended = [e for e in self._entries.values() if e is not entry and not e.running]
        running = [e for e in self._entries.values() if e is not entry and e.running]
        dropped = (ended + running)[:over]
        for old in dropped:
            del self._entries[old.id]
        return dropped

    def ended(self, entry: StoredResponse) -> None:
        """Its generation ended (completed, failed, cancelled): its TTL starts now."""
        if self.ttl_s < 0:
            return
        entry.expires_at = self.clock() + self.ttl_s
        self._count += 1
        heapq.heappush(self._expiry, (entry.expires_at, self._count, entry.id))
        if len(self._expiry) > 2 * self.max_stored + 64:  # dropped entries' leave with them
            self._expiry = [x for x in self._expiry if x[2] in self._entries]
            heapq.heapify(self._expiry)

    def get(self, response_id: str, key: ApiKey | None) -> StoredResponse | None:
        self._purge()
        entry = self._entries.get(response_id)
        if entry is None or not visible(entry, key):
            return None
        return entry

    def delete(self, response_id: str, key: ApiKey | None) -> StoredResponse | None:
        entry = self.get(response_id, key)
        if entry is not None:
            del self._entries[response_id]
        return entry

    def _purge(self) -> None:
        now = self.clock()
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, _, response_id = heapq.heappop(self._expiry)
            entry = self._entries.get(response_id)
            if entry is not None and entry.expires_at == expires_at:
                del self._entries[response_id]
