"""The prefix cache as the scheduler sees it: what a prompt costs to prefill, and when a
prompt should wait for KV that another request is computing.

Clients that share a long prompt prefix (agents with one system prompt, a fan-out of one
document) often arrive together, before any of them has left KV in the cache. Prefilled side
by side, each computes the same prefix again: on hardware whose prefill is compute-bound (a
Mac, a CPU) four of them take four times as long. So a waiting request whose prompt shares
at least `min_tokens` not yet cached tokens with a request being prefilled waits: that
request leaves its prompt's KV in the cache with its first token (engine/core.py), and the
waiting one then prefills only the rest. It keeps its place in the queue; requests behind it
that share nothing go ahead.
"""

from __future__ import annotations

from worker.engine.prefix_cache import BLOCK, PrefixCache
from worker.engine.request import Request


class PrefixPlan:
    def __init__(self, cache: PrefixCache, min_tokens: int) -> None:
        self.cache = cache
        self.min_tokens = min_tokens
        self.inflight: dict[int, int] = {}  # block key -> requests prefilling a prompt with it
        self.registered: dict[str, list[int]] = {}  # request id -> the keys it counts in

    def new_tokens(self, request: Request) -> int:
        return len(request.prompt) - self.cache.match(request.prefix_key)[1]

    def waits(self, request: Request) -> bool:
        if not self.inflight or len(request.prompt) <= self.min_tokens:
            return False
        shared = 0
        for key in request.prefix_key.chain:
            if key not in self.inflight:
                break
            shared += 1
        if shared * BLOCK < self.min_tokens:
            return False
        return shared * BLOCK - self.cache.match(request.prefix_key)[1] >= self.min_tokens

    def admitted(self, request: Request, new_tokens: int) -> None:
        if new_tokens < self.min_tokens:
            return
        keys = request.prefix_key.chain
        self.registered[request.request_id] = keys
        for key in keys:
            self.inflight[key] = self.inflight.get(key, 0) + 1

    def prefilled(self, request_id: str) -> None:
        """Its prompt's KV is in the cache now, or it is gone: nothing to wait for."""
        for key in self.registered.pop(request_id, ()):
            left = self.inflight[key] - 1
            if left:
                self.inflight[key] = left
            else:
                del self.inflight[key]
