"""RequestStream: one request's deltas, merged while the reader is slow (bounded memory)."""

from __future__ import annotations

import asyncio

import msgspec

from shared.protocol import Add
from shared.types import ErrorCode, FinishReason, RequestError, RequestKind, RequestOutput

# What a continuation can resume: text made token by token (not audio, not vectors)
RESUMABLE = frozenset({RequestKind.CHAT, RequestKind.COMPLETION})

# What `get` hands a reader whose stream is paused (its worker died, a continuation waits for
# the next one) and has had nothing for a while: no output, a cue to keep the client's
# connection alive (an SSE comment).
PAUSE = RequestOutput("")


class RequestStream:
    __slots__ = (
        "_cleared",
        "_pending",
        "_waiter",
        "add",
        "alone",
        "crashes",
        "finished",
        "model",
        "paused",
        "probation",
        "received",
        "request_id",
        "resumes",
        "strikes",
        "tokens",
        "worker_id",
    )

    def __init__(self, request_id: str, model: str, worker_id: str) -> None:
        self.request_id = request_id
        self.model = model
        self.worker_id = worker_id  # the worker it runs on now ("" while queued)
        self.finished = False
        self.received = False  # the worker produced output: it can no longer be replayed
        self.add: Add | None = None  # what was sent, for a replay on a restarted worker
        self.tokens: list[int] = []  # the tokens received: what a continuation resumes from
        self.resumes = 0  # times it was resumed on another worker after its own died
        self.crashes = 0  # workers that died while holding it: a suspect once this is > 0
        self.strikes = 0  # of those deaths, the ones laid at its door (see recovery)
        # sent again after a crash and no output since: a death now may be its doing
        self.probation = False
        self._cleared: asyncio.Event | None = None
        self.alone = False  # on probation at a death with others: its next trial is alone
        self.paused = False  # its worker died after it made output: it waits for the next
        self._pending: RequestOutput | Backlog | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, output: RequestOutput) -> None:
        if self.finished:
            return  # exactly one terminal event per request
        if output.finish_reason is not None:
            self.finished = True
        if output.token_ids or output.text or output.reasoning or output.tool_calls or output.audio:
            self.received = True
            self.paused = False
            self.off_probation()
        elif self.finished:
            self.off_probation()
        self.tokens += output.token_ids
        pending = self._pending
        if pending is None or pending is PAUSE:
            self._pending = output
        elif isinstance(pending, Backlog):
            pending.add(output)
        else:
            self._pending = Backlog(self.request_id, pending, output)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def resumable(self) -> bool:
        """Made text only so far: another worker can go on from its tokens."""
        add = self.add
        return add is not None and add.kind in RESUMABLE and bool(self.tokens)

    def next_add(self) -> Add:
        """What to send a worker now: the request, or its continuation from the tokens
        received (after its worker died with it)."""
        add = self.add
        assert add is not None
        if not self.tokens:
            return add
        request = msgspec.structs.replace(add.request, resumed=list(self.tokens))
        return msgspec.structs.replace(add, request=request)

    def nudge(self) -> None:
        """A paused stream's reader gets PAUSE if it has nothing else to read."""
        if self.paused and not self.finished and self._pending is None:
            self._pending = PAUSE
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def on_probation(self) -> None:
        self.probation = True
        self._cleared = asyncio.Event()

    def off_probation(self) -> None:
        """It made output (or ended, or was aborted): a death from now on is not its own."""
        self.probation = False
        if self._cleared is not None:
            self._cleared.set()

    async def cleared(self) -> None:
        """Until it is off probation."""
        if self.probation and self._cleared is not None:
            await self._cleared.wait()

    def fail(self, code: ErrorCode, message: str) -> None:
        error = RequestError(code, message)
        self.put(RequestOutput(self.request_id, finish_reason=FinishReason.ERROR, error=error))

    async def get(self) -> RequestOutput:
        """The deltas since the last call, merged into one (one reader at a time)."""
        while self._pending is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pending, self._pending = self._pending, None
        assert pending is not None
        return pending.merged() if isinstance(pending, Backlog) else pending


class Backlog:
    """Deltas a slow reader has not taken yet, merged into one when it takes them. Each delta
    is added in place (lists extended, strings and bytes kept as pieces, joined once): a
    client that stops reading costs the gateway O(1) per delta, not a copy of all it has
    not read."""

    __slots__ = ("audio", "embeddings", "head", "reasoning", "text")

    def __init__(self, request_id: str, first: RequestOutput, second: RequestOutput) -> None:
        # A copy: the lists it extends are its own, not the first delta's.
        self.head = RequestOutput(
            request_id,
            token_ids=list(first.token_ids),
            finish_reason=first.finish_reason,
            usage=first.usage,
            error=first.error,
            logprobs=list(first.logprobs),
            prompt_logprobs=first.prompt_logprobs,
            prompt_text=first.prompt_text,
            stop=first.stop,
            timings=first.timings,
            tool_calls=list(first.tool_calls),
            dimensions=first.dimensions,
            scores=list(first.scores),
            segments=list(first.segments),
            language=first.language,
            duration=first.duration,
        )
        self.text = [first.text]
        self.reasoning = [first.reasoning]
        self.embeddings = bytearray(first.embeddings)
        self.audio = bytearray(first.audio)
        self.add(second)

    def add(self, output: RequestOutput) -> None:
        head = self.head
        self.text.append(output.text)
        self.reasoning.append(output.reasoning)
        self.embeddings += output.embeddings
        self.audio += output.audio
        head.token_ids += output.token_ids
        head.logprobs += output.logprobs
        head.tool_calls += output.tool_calls
        head.scores += output.scores
        head.segments += output.segments
        head.finish_reason = output.finish_reason
        head.usage = output.usage or head.usage
        head.error = output.error or head.error
        head.prompt_logprobs = head.prompt_logprobs or output.prompt_logprobs
        if head.prompt_text is None:
            head.prompt_text = output.prompt_text
        head.stop = output.stop
        head.timings = head.timings or output.timings
        head.dimensions = output.dimensions or head.dimensions
        if output.language is not None:
            head.language = output.language
        if output.duration is not None:
            head.duration = output.duration

    def merged(self) -> RequestOutput:
        head = self.head
        head.text = "".join(self.text)
        head.reasoning = "".join(self.reasoning)
        head.embeddings = bytes(self.embeddings)
        head.audio = bytes(self.audio)
        return head
