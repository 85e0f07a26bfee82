"""Which waiting requests join the running batch at the next engine step.

A pure policy over queues: no model, no sockets, no clock (nothing waits on time). Each
step it admits, in order (interactive requests first, first come first served within a
class):
- while the batch has a free place (`max_running`);
- at most `max_prefill_requests` new requests a step (what the backend prefills side by
  side) and `max_prefill_tokens` new prompt tokens (a cached prefix costs nothing), except
  that the first request of a step always fits: one long prompt goes in alone;
- batch-class requests only while they hold less than `batch_share` of `max_running`, so
  that an interactive request always finds a place;
- unless the plan (the engine's prefix cache) holds a request back: one whose long prompt
  prefix is being prefilled for another request waits for that KV instead of computing it
  again, and keeps its place in the queue; so does one whose grammar is still being
  compiled (on a thread of its own), while those behind it go ahead;
- while the KV memory is free for it: what the running requests hold now (prompt and tokens
  made so far) plus the new prompt and up to `DECODE_RESERVE` tokens of its output fit in
  `kv_budget_bytes`. Reserving every request's whole max_tokens up front would hold most of
  a Mac's memory for outputs that are rarely that long. A request alone in the batch is
  admitted whatever its size (the preprocessor already bounded it by the context length),
  so nothing waits forever.
A lone request on an idle engine starts at once: nothing waits for company.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from shared.types import Priority
from worker.engine.request import Request, RequestStatus

DECODE_RESERVE = 256  # output tokens of KV a new request must find room for


class Plan(Protocol):
    """What the scheduler asks about a waiting request's prompt."""

    def new_tokens(self, request: Request) -> int:
        """The prompt tokens it would prefill (a cached prefix costs nothing)."""
        ...

    def waits(self, request: Request) -> bool:
        """Hold it back this step (a request being prefilled will share its prefix)."""
        ...

    def admitted(self, request: Request, new_tokens: int) -> None:
        """It starts this step, prefilling `new_tokens` of its prompt."""
        ...


class FullPrefill:
    """No prefix cache: every prompt is prefilled whole, and nothing waits."""

    def new_tokens(self, request: Request) -> int:
        return len(request.prompt)

    def waits(self, request: Request) -> bool:
        return False

    def admitted(self, request: Request, new_tokens: int) -> None:
        pass


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_running: int = 64
    max_prefill_requests: int = 8
    max_prefill_tokens: int = 8192
    batch_share: float = 0.75
    kv_budget_bytes: int | None = None  # None: no limit but max_running
    kv_bytes_per_token: int = 0

    @property
    def batch_places(self) -> int:
        return max(1, int(self.max_running * self.batch_share))


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.queues: dict[bool, deque[Request]] = {False: deque(), True: deque()}  # batch?
        self.running: dict[str, Request] = {}
        self.batch_running = 0

    @property
    def waiting(self) -> int:
        return len(self.queues[False]) + len(self.queues[True])

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.running or any(r.request_id == request_id for r in self._queued())

    def _queued(self) -> Iterator[Request]:
        yield from self.queues[False]
        yield from self.queues[True]

    def add(self, request: Request) -> None:
        """Queued last, but a continuation (its client mid-stream since before its worker
        died) first: it has waited longest, and the gateway waits for its output."""
        request.status = RequestStatus.WAITING
        queue = self.queues[request.priority >= Priority.BATCH]
        if request.resumed:
            queue.appendleft(request)
        else:
            queue.append(request)

    def schedule(self, plan: Plan | None = None) -> list[Request]:
        """The requests to start now, removed from the queues and counted as running. `plan`
        (the engine's prefix cache) prices each request's prefill and may hold one back."""
        if not self.waiting:
            return []
        plan = plan or FullPrefill()
        config = self.config
        admitted: list[Request] = []
        tokens = 0
        kv_used = self.kv_tokens() * config.kv_bytes_per_token if config.kv_budget_bytes else 0
        for is_batch in (False, True):
            queue = self.queues[is_batch]
            held: list[Request] = []  # waiting on purpose: they keep their place
            while queue and len(admitted) < config.max_prefill_requests:
                request = queue[0]
                if len(self.running) >= config.max_running:
                    break
                if is_batch and self.batch_running >= config.batch_places:
                    break
                kv = _kv_need(request) * config.kv_bytes_per_token
                budget = config.kv_budget_bytes
                if budget is not None and self.running and kv_used + kv > budget:
                    break  # first come, first served: no overtaking a large one
                if not request.ready or plan.waits(request):
                    held.append(queue.popleft())
                    continue
                prefill = plan.new_tokens(request)
                if admitted and tokens + prefill > config.max_prefill_tokens:
                    break
                queue.popleft()
                tokens += prefill
                kv_used += kv
                self.running[request.request_id] = request
                self.batch_running += request.priority >= Priority.BATCH
                admitted.append(request)
                plan.admitted(request, prefill)
            queue.extendleft(reversed(held))
        return admitted

    def startable(self) -> bool:
        """A waiting request could start (not all of them wait on something being made)."""
        return any(r.ready for r in self._queued())

    def kv_tokens(self) -> int:
        """KV positions the running requests hold now (a continuation's prompt holds the
        tokens it resumed, which its completion count starts at)."""
        return sum(len(r.prompt) + r.completion_tokens - r.resumed for r in self.running.values())

    def finish(self, request_id: str) -> Request | None:
        """A running request is done (finished or aborted): its place and KV are free."""
        request = self.running.pop(request_id, None)
        if request is not None:
            self.batch_running -= request.priority >= Priority.BATCH
        return request

    def remove_waiting(self, request_ids: set[str]) -> list[Request]:
        """Take these requests out of the queues (an abort before they started)."""
        removed: list[Request] = []
        for is_batch, queue in self.queues.items():
            if any(r.request_id in request_ids for r in queue):
                removed += [r for r in queue if r.request_id in request_ids]
                self.queues[is_batch] = deque(r for r in queue if r.request_id not in request_ids)
        return removed


def _kv_need(request: Request) -> int:
    return len(request.prompt) + min(request.max_tokens, DECODE_RESERVE)
