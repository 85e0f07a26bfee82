"""Relay a request's streams to a client: protocol-neutral, with deadline and abort on exit.

A request is one or more choices (OpenAI's `n`, or a batch of completion prompts), each its
own RequestStream in the worker's batch. A Formatter (one per protocol) turns their deltas
into complete encoded bodies or SSE events. Errors before the first byte are raised as
GatewayError (the router renders a status and body); after the first byte they become the
protocol's error event, then the stream's end, and the other choices are aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.edge.context import RequestContext
from gateway.errors import GatewayError
from gateway.workers.client import PAUSE, RequestStream, WorkerClient
from shared.types import (
    ErrorCode,
    FinishReason,
    RequestError,
    RequestOutput,
    Segment,
    TokenLogprob,
    ToolCall,
    Usage,
)

ABORTED_BY_SERVER = RequestError(
    ErrorCode.SHUTTING_DOWN, "the request was aborted because its model is being unloaded"
)


@dataclass(slots=True)
class Choice:
    """One choice, collected whole (non-streaming responses)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_text: str | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    stop: str | None = None  # the stop string that ended it
    tool_calls: list[ToolCall] = field(default_factory=list)  # in index order
    embeddings: bytes = b""  # an embedding request's vectors (RequestOutput.embeddings)
    dimensions: int = 0
    scores: list[float] = field(default_factory=list)  # a rerank request's, per document
    # A transcription's (RequestOutput's): its timed segments, the language heard, seconds
    segments: list[Segment] = field(default_factory=list)
    language: str | None = None
    duration: float | None = None
    # text and reasoning as they came, joined when read (not copied per delta)
    pieces: list[str] = field(default_factory=list)
    thoughts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return _joined(self.pieces)

    @property
    def reasoning(self) -> str:
        return _joined(self.thoughts)

    def add(self, output: RequestOutput) -> None:
        if output.embeddings:
            self.embeddings += output.embeddings
            self.dimensions = output.dimensions
        if output.scores:
            self.scores += output.scores
        self.segments += output.segments
        if output.language is not None:
            self.language = output.language
        if output.duration is not None:
            self.duration = output.duration
        if output.text:
            self.pieces.append(output.text)
        if output.reasoning:
            self.thoughts.append(output.reasoning)
        for delta in output.tool_calls:
            if delta.index == len(self.tool_calls):
                self.tool_calls.append(ToolCall(delta.id, delta.name, ""))
            call = self.tool_calls[delta.index]
            call.arguments += delta.arguments
        self.token_ids += output.token_ids
        self.logprobs += output.logprobs
        if output.prompt_text is not None:
            self.prompt_text = output.prompt_text
            self.prompt_logprobs = output.prompt_logprobs
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
            self.usage = output.usage
            self.stop = output.stop


class Formatter(Protocol):
    """Encodes one request's responses in one protocol. The stream_* methods return complete
    SSE bytes (b"" for nothing to send); `index` is the choice. stream_start sees the first
    delta (whose usage has the prompt's token count) before stream_delta gets it."""

    def stream_start(self, first: RequestOutput) -> bytes: ...
    def stream_delta(self, index: int, output: RequestOutput) -> bytes: ...
    def stream_finish(self, index: int, output: RequestOutput) -> bytes: ...
    def stream_end(self, usage: Usage) -> bytes: ...
    def stream_error(self, error: GatewayError) -> bytes: ...
    def response(self, choices: list[Choice], usage: Usage) -> bytes: ...


class WholeBody:
    """The streaming half of a Formatter for a response that is never streamed (embeddings,
    rerank): its route serves a JSON body only, so reaching these is a bug."""

    def _streamed(self, *_: Any) -> bytes:
        raise AssertionError(f"{type(self).__name__} is not streamed")

    stream_start = stream_delta = stream_finish = stream_end = stream_error = _streamed


def _joined(pieces: list[str]) -> str:
    if len(pieces) > 1:
        pieces[:] = ["".join(pieces)]
    return pieces[0] if pieces else ""


def total_usage(usages: list[Usage | None], groups: list[int]) -> Usage:
    """Prompt tokens once per prompt (choices of one prompt share it), completions summed.
    A prompt's cached tokens come from the same choice as its count, so they never exceed it."""
    prompts: dict[int, Usage] = {}
    completion = reasoning = 0
    for usage, group in zip(usages, groups, strict=True):
        if usage is None:
            continue
        prompts.setdefault(group, usage)
        completion += usage.completion_tokens
        reasoning += usage.reasoning_tokens
    prompt = sum(u.prompt_tokens for u in prompts.values())
    return Usage(prompt, completion, sum(u.cached_tokens for u in prompts.values()), reasoning)


class Relay:
    """One request's consumption of its streams, bounded by a deadline.

    Until a streaming response takes over (Litestar's Stream listens for the disconnect
    itself), a watcher on the ASGI receive channel turns a client disconnect into an abort.
    """

    def __init__(
        self,
        workers: WorkerClient,
        streams: list[RequestStream],
        timeout_s: float,
        receive: Callable[[], Awaitable[Any]] | None = None,
        ctx: RequestContext | None = None,
        groups: list[int] | None = None,
    ) -> None:
        self.workers = workers
        self.streams = streams
        self.groups = groups if groups is not None else list(range(len(streams)))
        self.ctx = ctx
        self.timeout_s = timeout_s
        self.usages: list[Usage | None] = [None] * len(streams)
        self.done: set[int] = set()
        self._gets: dict[int, asyncio.Future[RequestOutput]] = {}
        # One timer per request, not one per token: expiry aborts and ends the streams.
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire)
        self._watcher = asyncio.create_task(self._watch(receive)) if receive else None

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.streams)

    def _expire(self) -> None:
        message = f"the request timed out (server.request_timeout_s={self.timeout_s:g})"
        for stream in self.streams:
            if not stream.finished:
                self.workers.abort(stream)
                stream.fail(ErrorCode.TIMEOUT, message)

    async def _watch(self, receive: Callable[[], Awaitable[Any]]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        # Abort in the workers and end every stream; the reader (collect) wakes up with the
        # terminal outputs and closes the relay itself.
        self._timer.cancel()
        self._abort_unfinished()
        for stream in self.streams:
            stream.fail(ErrorCode.CANCELLED, "the client disconnected")

    def stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    async def _get(self) -> tuple[int, RequestOutput]:
        if len(self.streams) == 1:
            return 0, await self.streams[0].get()
        for i, stream in enumerate(self.streams):
            if i not in self.done and i not in self._gets:
                self._gets[i] = asyncio.ensure_future(stream.get())
        ready, _ = await asyncio.wait(self._gets.values(), return_when=asyncio.FIRST_COMPLETED)
        index = min(i for i, task in self._gets.items() if task in ready)
        return index, self._gets.pop(index).result()

    async def next(self) -> tuple[int, RequestOutput]:
        """The next delta of any choice (merged deltas of one choice while the reader lags)."""
        index, output = await self._get()
        if output.finish_reason == FinishReason.ABORT:
            output.error = ABORTED_BY_SERVER
        ctx = self.ctx
        if ctx is not None and output.token_ids:
            ctx.token(len(output.token_ids))
        if ctx is not None and output.timings is not None and ctx.worker_timings is None:
            ctx.worker_timings = output.timings
        if ctx is not None and output.usage is not None and output.finish_reason is None:
            ctx.prompt(output.usage.prompt_tokens)  # the first token's: the prompt's size
        if output.finish_reason is not None:
            self.done.add(index)
            self.usages[index] = output.usage
            if ctx is not None:
                ctx.finish_reason = output.finish_reason.value
                if output.error is not None:
                    ctx.error_code = output.error.code.value
                usage = self.usage()
                ctx.prompt_tokens = usage.prompt_tokens
                ctx.completion_tokens = usage.completion_tokens
                ctx.cached_tokens = usage.cached_tokens
        return index, output

    def usage(self) -> Usage:
        return total_usage(self.usages, self.groups)

    async def first(self) -> tuple[int, RequestOutput]:
        """The first delta; a failure here is still a plain HTTP error."""
        try:
            index, output = await self.next()
            while output is PAUSE:
                index, output = await self.next()
        except BaseException:
            self.close()
            self.stop_watching()
            raise
        if output.error is not None:
            self.close()
            self.stop_watching()
            raise GatewayError.from_request_error(output.error)
        return index, output

    def close(self) -> None:
        """The relay is done: abort in the worker every choice that has not finished there."""
        self._timer.cancel()
        for task in self._gets.values():
            task.cancel()
        self._gets.clear()
        self._abort_unfinished()

    def _abort_unfinished(self) -> None:
        for stream in self.streams:
            if not stream.finished:
                self.workers.abort(stream)

    async def collect(self, fmt: Formatter) -> bytes:
        try:
            choices = [Choice(i) for i in range(len(self.streams))]
            index, output = await self.first()
            while True:
                if output.error is not None:
                    raise GatewayError.from_request_error(output.error)
                if output is not PAUSE:
                    choices[index].add(output)
                if self.finished:
                    break
                index, output = await self.next()
            return fmt.response(choices, self.usage())
        finally:
            self.close()
            self.stop_watching()

    async def sse(
        self, fmt: Formatter, first: tuple[int, RequestOutput], keepalive: bytes = b""
    ) -> AsyncIterator[bytes]:
        """Complete SSE events only; a client disconnect lands in `finally` as an abort.
        `keepalive` (an SSE comment) goes out while a choice is paused for a new worker."""
        try:
            index, output = first
            start = fmt.stream_start(output)
            if start:
                yield start
            while True:
                if output is PAUSE:
                    if keepalive:
                        yield keepalive
                    index, output = await self.next()
                    continue
                if output.error is not None:
                    yield fmt.stream_error(GatewayError.from_request_error(output.error))
                    return
                delta = fmt.stream_delta(index, output)
                if delta:
                    yield delta
                if output.finish_reason is not None:
                    end = fmt.stream_finish(index, output)
                    if end:
                        yield end
                    if self.finished:
                        break
                index, output = await self.next()
            end = fmt.stream_end(self.usage())
            if end:  # a raw stream (speech audio) ends with nothing: no empty body message
                yield end
        finally:
            self.close()


def sse_data(data: bytes) -> bytes:
    """One unnamed SSE event (OpenAI's framing)."""
    return b"data: " + data + b"\n\n"


def sse_event(name: str, data: bytes) -> bytes:
    """One named SSE event (Anthropic's and the Responses API's framing)."""
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


DONE = b"data: [DONE]\n\n"
