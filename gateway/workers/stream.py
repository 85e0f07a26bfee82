"""RequestStream: one request's deltas, merged while the reader is slow (bounded memory)."""

from __future__ import annotations

import asyncio

import msgspec

from shared.protocol import Add
from shared.types import ErrorCode, FinishReason, RequestError, RequestKind, RequestOutput

# What a continuation can resume: text made token by token (not audio, not vectors)
RESUMABLE = frozenset({RequestKind.CHAT, RequestKind.COMPLETION})


class RequestStream:
    __slots__ = (
        "_cleared",
        "_pending",
        "_waiter",
        "add",
        "crashes",
        "finished",
        "model",
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
        self._pending: RequestOutput | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, output: RequestOutput) -> None:
        if self.finished:
            return  # exactly one terminal event per request
        if output.finish_reason is not None:
            self.finished = True
        if output.token_ids or output.text or output.reasoning or output.tool_calls or output.audio:
            self.received = True
            self.off_probation()
        elif self.finished:
            self.off_probation()
        self.tokens += output.token_ids
        pending = self._pending
        if pending is None:
            self._pending = output
        else:
            self._pending = RequestOutput(
                self.request_id,
                text=pending.text + output.text,
                token_ids=pending.token_ids + output.token_ids,
                finish_reason=output.finish_reason,
                usage=output.usage or pending.usage,
                error=output.error or pending.error,
                logprobs=pending.logprobs + output.logprobs,
                prompt_logprobs=pending.prompt_logprobs or output.prompt_logprobs,
                prompt_text=pending.prompt_text
                if pending.prompt_text is not None
                else output.prompt_text,
                stop=output.stop,
                timings=pending.timings or output.timings,
                reasoning=pending.reasoning + output.reasoning,
                tool_calls=pending.tool_calls + output.tool_calls,
                embeddings=pending.embeddings + output.embeddings,
                dimensions=output.dimensions or pending.dimensions,
                scores=pending.scores + output.scores,
                segments=pending.segments + output.segments,
                language=output.language if output.language is not None else pending.language,
                audio=pending.audio + output.audio,
                duration=output.duration if output.duration is not None else pending.duration,
            )
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
        output, self._pending = self._pending, None
        assert output is not None
        return output
