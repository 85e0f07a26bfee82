"""Serving one generation request, whatever protocol it came in: protocol-neutral plumbing
shared by the OpenAI, Anthropic and Responses routes.

A route decodes its body, translates it into Jobs (canonical request + sampling, one per
prompt), picks a Formatter, and calls `serve`: authorization of the model, limits, the
submissions (n choices per job, in one batch), registration for cancel-by-id, and the relay
as a JSON body or an SSE stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.datastructures import State
from litestar.response import Stream

from gateway.api.images import ImageLimits, images_in, resolve_images
from gateway.api.relay import Formatter, Relay
from gateway.edge.context import RequestContext
from gateway.edge.middleware import authorize_model, context_of
from gateway.errors import GatewayError
from gateway.workers.client import RequestStream, Submission, WorkerClient
from shared.types import CanonicalRequest, ErrorCode, Priority, RequestKind, SamplingParams

JSON = "application/json"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE_S = 2.0  # SSE comment interval while a model loads for a streaming request
RESUMING = b": resuming on a new worker\n\n"  # while a stream waits for its next worker
MAX_CHOICES = 128  # n x prompts per request


@dataclass(slots=True)
class Job:
    """One prompt of a request; `n` independent choices are sampled from it."""

    request: CanonicalRequest
    sampling: SamplingParams


@dataclass(slots=True)
class Served:
    """What a route asked for, for `serve`."""

    model: str
    kind: RequestKind
    jobs: list[Job]
    n: int = 1
    stream: bool = False
    keep_alive: float | None = None
    # max_tokens when the request gives none (completions: 16, as OpenAI), at most the
    # server's cap; None: the worker's default (the rest of the context).
    default_max_tokens: int | None = None
    user: str | None = None  # an end-user id the client sent, for the access log
    # The body's type when it is not JSON (or, streamed, not SSE events): a transcript as
    # text, speech audio as it is made. A raw stream gets no keep-alive comments while its
    # model loads (they would corrupt it), so an error before its first byte is a status.
    media_type: str | None = None


@dataclass(slots=True, eq=False)
class _Entry:
    ctx: RequestContext | None
    streams: list[RequestStream]
    on_cancel: Callable[[], None] | None = None  # before its streams exist (a model loading)


class InFlight:
    """Requests being served, by request id, for POST /v1/requests/{id}/cancel."""

    def __init__(self) -> None:
        self.requests: dict[str, _Entry] = {}
        # A client's own X-Request-Id names its request too: a non-streaming client learns
        # the gateway's id only with the response, too late to cancel. Each key has its own
        # (another key's request of the same id must not hide it).
        self.client_ids: dict[tuple[str | None, str], str] = {}

    def add(
        self,
        request_id: str,
        ctx: RequestContext | None,
        streams: list[RequestStream],
        on_cancel: Callable[[], None] | None = None,
    ) -> None:
        self.requests[request_id] = _Entry(ctx, streams, on_cancel)
        if ctx is not None and ctx.client_request_id:
            self.client_ids[(_key_id(ctx), ctx.client_request_id)] = request_id

    def remove(self, request_id: str) -> None:
        entry = self.requests.pop(request_id, None)
        ctx = entry.ctx if entry else None
        if ctx is not None and ctx.client_request_id:
            named = (_key_id(ctx), ctx.client_request_id)
            if self.client_ids.get(named) == request_id:
                del self.client_ids[named]

    def cancel(self, workers: WorkerClient, request_id: str, by: RequestContext | None) -> int:
        """Abort a request's unfinished choices; they end with a `cancelled` error. Only its
        own key (or an admin key) may cancel it; anyone else sees it as unknown (404)."""
        entry = self.requests.get(request_id)
        if entry is None:
            entry = self.requests.get(self._by_client_id(request_id, by) or "")
        if entry is None or not _may_cancel(by, entry.ctx):
            raise GatewayError(
                ErrorCode.NOT_FOUND,
                f"no request {request_id!r} is in flight",
                "request_id",
            )
        if not entry.streams and entry.on_cancel is not None:  # still waiting for its model
            entry.on_cancel()
            return 1
        cancelled = 0
        for stream in entry.streams:
            if not stream.finished:
                workers.abort(stream)
                stream.fail(ErrorCode.CANCELLED, f"request {request_id} was cancelled")
                cancelled += 1
        return cancelled

    def _by_client_id(self, client_id: str, by: RequestContext | None) -> str | None:
        """The request the caller's key named `client_id` (an admin key: any key's, the
        latest)."""
        found = self.client_ids.get((_key_id(by), client_id))
        if found is None and by is not None and by.key is not None and by.key.scope == "admin":
            named = [rid for (_, cid), rid in self.client_ids.items() if cid == client_id]
            found = named[-1] if named else None
        return found


def _key_id(ctx: RequestContext | None) -> str | None:
    return ctx.key.id if ctx is not None and ctx.key is not None else None


def _may_cancel(by: RequestContext | None, owner: RequestContext | None) -> bool:
    if by is None or by.key is None:  # an open gateway: no keys, no owners
        return True
    if by.key.scope == "admin":
        return True
    return owner is not None and owner.key is not None and owner.key.id == by.key.id


def priority_of(ctx: RequestContext | None) -> int:
    if ctx is None or ctx.key is None or ctx.key.priority == "interactive":
        return Priority.INTERACTIVE
    return Priority.BATCH


def capped(sampling: SamplingParams, cap: int | None, param: str = "max_tokens") -> SamplingParams:
    """server.max_tokens_cap: a request asking for more is refused, one asking for nothing
    gets the cap."""
    if cap is None:
        return sampling
    if sampling.max_tokens is None:
        return msgspec.structs.replace(sampling, max_tokens=cap)
    if sampling.max_tokens > cap:
        raise GatewayError(
            ErrorCode.INVALID_REQUEST,
            f"{param} is {sampling.max_tokens}; this gateway allows at most {cap} "
            "(server.max_tokens_cap)",
            param,
        )
    return sampling


def needs_of(
    kind: RequestKind, sampling: SamplingParams, request: CanonicalRequest | None = None
) -> list[str]:
    """The model capabilities a request relies on (checked against the worker's Ready)."""
    if kind == RequestKind.EMBEDDING:
        return ["embeddings"]
    if kind == RequestKind.RERANK:
        return ["rerank"]
    if kind in (RequestKind.TRANSCRIPTION, RequestKind.TRANSLATION, RequestKind.SPEECH):
        return [kind.value]  # the capability is named after its kind
    needs = ["chat" if kind == RequestKind.CHAT else "completion"]
    if sampling.logprobs:
        needs.append("logprobs")
    if sampling.echo:
        needs.append("echo")
    if request is not None:
        needs += request.needs()
    return needs


async def submit_all(
    workers: WorkerClient,
    served: Served,
    ctx: RequestContext | None,
    max_tokens_cap: int | None,
) -> tuple[list[RequestStream], list[int]]:
    """Every choice into the worker's batch: n per job, each sampled independently (a seed
    becomes seed + choice index). All or nothing: a refusal aborts those already sent."""
    total = served.n * len(served.jobs)
    if total > MAX_CHOICES:
        raise GatewayError(
            ErrorCode.INVALID_REQUEST,
            f"this request asks for {total} choices (n x prompts); at most {MAX_CHOICES}",
            "n",
        )
    request_id = ctx.request_id if ctx else None
    streams: list[RequestStream] = []
    groups: list[int] = []
    try:
        for job_index, job in enumerate(served.jobs):
            sampling = job.sampling
            if sampling.max_tokens is None and served.default_max_tokens is not None:
                default = min(served.default_max_tokens, max_tokens_cap or 2**31)
                sampling = msgspec.structs.replace(sampling, max_tokens=default)
            sampling = capped(sampling, max_tokens_cap)
            for j in range(served.n):
                choice_sampling = sampling
                if j and sampling.seed is not None:
                    seed = sampling.seed + j
                    if seed >= 2**64:  # wraps: MLX takes seeds modulo 2**64 anyway
                        seed -= 2**64
                    choice_sampling = msgspec.structs.replace(sampling, seed=seed)
                index = len(streams)
                rid = request_id if total == 1 or request_id is None else f"{request_id}-{index}"
                submission = Submission(
                    served.model,
                    served.kind,
                    job.request,
                    choice_sampling,
                    request_id=rid,
                    priority=priority_of(ctx),
                    keep_alive=served.keep_alive,
                    needs=needs_of(served.kind, sampling, job.request),
                    affinity=f"user:{served.user}" if served.user else None,
                )
                stream = await workers.submit(submission)
                streams.append(stream)
                groups.append(job_index)
    except BaseException:
        for stream in streams:
            workers.abort(stream)
        raise
    return streams, groups


async def with_images(state: State, served: Served) -> None:
    """Each job's images fetched and checked (gateway/api/images.py), once the model is
    known to take them: a text model's 400 comes first, and nothing is fetched for it."""
    limits = ImageLimits.of(state.config.server)
    workers: WorkerClient = state.workers
    for index, job in enumerate(served.jobs):
        if images_in(job.request):
            workers.check(served.model, needs_of(served.kind, job.sampling, job.request))
            resolved = await resolve_images(job.request, limits, served.n)
            served.jobs[index] = Job(resolved, job.sampling)


def authorize(request_: Request[Any, Any, Any], state: State, model: str) -> None:
    """The request's key may use `model` (a 404 for an unknown one, a 403 otherwise)."""
    workers: WorkerClient = state.workers
    authorize_model(context_of(request_.scope), model, lambda name: workers.resolve(name).name)


async def serve(
    request_: Request[Any, Any, Any], state: State, served: Served, fmt: Formatter
) -> Response[bytes] | Stream:
    workers: WorkerClient = state.workers
    server = state.config.server
    ctx = context_of(request_.scope)
    authorize(request_, state, served.model)
    if ctx is not None:
        ctx.stream = served.stream
        if served.user:
            ctx.user = served.user[:128]
    await with_images(state, served)
    if served.stream and served.media_type is None and workers.must_load(served.model):
        # The model loads first: answer at once and keep the connection alive meanwhile.
        submit = submit_all(workers, served, ctx, server.max_tokens_cap)
        return Stream(
            _load_then_relay(state, served.model, submit, fmt, ctx),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    streams, groups = await submit_all(workers, served, ctx, server.max_tokens_cap)
    relay = relay_for(state, streams, groups, ctx, request_)
    if not served.stream:
        return Response(await relay.collect(fmt), media_type=served.media_type or JSON)
    first = await relay.first()
    relay.stop_watching()  # from here on, Litestar's Stream watches for the disconnect
    media_type = served.media_type or "text/event-stream"
    keepalive = b"" if served.media_type else RESUMING
    return Stream(relay.sse(fmt, first, keepalive), media_type=media_type, headers=SSE_HEADERS)


async def serve_detached(
    state: State, served: Served, fmt: Formatter, ctx: RequestContext | None
) -> None:
    """A generation no HTTP exchange waits on (a Responses background job), authorized
    already: submitted, registered and relayed like any other, its events go to `fmt` only.
    A refusal or a failure before the first output raises."""
    cap = state.config.server.max_tokens_cap
    await with_images(state, served)
    streams, groups = await submit_all(state.workers, served, ctx, cap)
    relay = relay_for(state, streams, groups, ctx)
    first = await relay.first()
    async for _ in relay.sse(fmt, first):
        pass  # the formatter keeps what it needs as the events go by


def relay_for(
    state: State,
    streams: list[RequestStream],
    groups: list[int],
    ctx: RequestContext | None,
    request_: Request[Any, Any, Any] | None = None,
) -> Relay:
    timeout = state.config.server.request_timeout_s
    receive = request_.receive if request_ is not None else None
    relay = Relay(state.workers, streams, timeout, receive, ctx, groups)
    if ctx is not None:
        inflight: InFlight = state.inflight
        inflight.add(ctx.request_id, ctx, streams)
        ctx.on_finish.append(lambda c: inflight.remove(c.request_id))
        # When the HTTP exchange ends, however it ends, nothing of it may keep running: a
        # streaming body's generator left suspended at a `yield` by a disconnect runs its
        # `finally` only when it is garbage-collected, which a reference cycle can delay
        # indefinitely (a generation left running in the worker, its slot held).
        ctx.on_finish.append(lambda c: relay.close())
    return relay


async def _load_then_relay(
    state: State,
    model: str,
    submit: Coroutine[Any, Any, tuple[list[RequestStream], list[int]]],
    fmt: Formatter,
    ctx: RequestContext | None,
) -> AsyncIterator[bytes]:
    """SSE comments every KEEPALIVE_S while the model loads, then the usual stream; a
    failure to load is an error event (the status line has gone out)."""
    workers: WorkerClient = state.workers
    task = asyncio.ensure_future(submit)
    handed_over: list[bool] = []
    cancelled: list[bool] = []

    def cancel() -> None:  # POST /v1/requests/{id}/cancel while the model loads
        cancelled.append(True)
        task.cancel()

    def cleanup(_: object = None) -> None:
        """Nothing outlives the response: the wait for the model, or streams not yet handed
        to a relay (which then owns them). Also run when the exchange ends, since a
        disconnect can leave this generator suspended at a `yield` until it is collected."""
        if not task.done():
            task.cancel()
        elif not handed_over and not task.cancelled() and task.exception() is None:
            for stream in task.result()[0]:
                workers.abort(stream)

    if ctx is not None:
        inflight: InFlight = state.inflight
        inflight.add(ctx.request_id, ctx, [], cancel)
        ctx.on_finish.append(lambda c: inflight.remove(c.request_id))
        ctx.on_finish.append(cleanup)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=KEEPALIVE_S)
            if not task.done():
                yield f": loading model {model}\n\n".encode()
        try:
            if cancelled:
                request_id = ctx.request_id if ctx else ""
                raise GatewayError(ErrorCode.CANCELLED, f"request {request_id} was cancelled")
            streams, groups = task.result()
            relay = relay_for(state, streams, groups, ctx)
            handed_over.append(True)
            first = await relay.first()
        except GatewayError as exc:
            yield fmt.stream_error(exc)
            return
        async for chunk in relay.sse(fmt, first, RESUMING):
            yield chunk
    finally:
        cleanup()
