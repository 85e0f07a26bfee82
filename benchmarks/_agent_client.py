"""Agent sessions against an OpenAI-compatible ``/v1/chat/completions`` endpoint.

Each turn sends the whole conversation so far (``Trace.messages``) as a streaming chat
completion (temperature 0, ``stream_options.include_usage``) and appends the reply exactly
as the server returned it, so every server sees its own consistent history. A session whose
turn fails stops there: its later turns would not be the trace's.

Sessions run concurrently. In lockstep (the default) turn ``t`` of every session is sent
together, once every session has its reply to turn ``t - 1``, so each turn is measured under
the same concurrency on every server; otherwise each session goes on as soon as it has its
reply, as independent agents would.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import msgspec

from benchmarks import _client
from benchmarks._agent_trace import Message, Trace
from benchmarks._client import _decode_event, sse_data


@dataclass(slots=True)
class TurnRecord:
    """One turn of one session; times are ``time.perf_counter()`` seconds."""

    session: int
    turn: int  # from 1
    start: float = 0.0
    end: float = 0.0
    first: float | None = None  # the first chunk with content
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    reply: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def total(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["reply"]
        d.update(ttft=self.ttft, total=self.total, reply_chars=len(self.reply))
        return d


def usage_tokens(usage: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    """(prompt, completion, cached) tokens of an OpenAI ``usage`` object; cached tokens are
    ``prompt_tokens_details.cached_tokens``, None where the server does not report them."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return usage.get("prompt_tokens"), usage.get("completion_tokens"), cached


def chat_body(
    model: str, messages: list[Message], max_tokens: int, ignore_eos: bool
) -> dict[str, Any]:
    return _client.chat_body(model, [dict(m) for m in messages], max_tokens, ignore_eos)


async def send_turn(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], rec: TurnRecord
) -> None:
    """Stream one chat completion into ``rec``; never raises (errors land in ``rec``)."""
    usage: dict[str, Any] | None = None
    parts: list[str] = []
    rec.start = time.perf_counter()
    try:
        async with client.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                detail = (await resp.read())[:200].decode("utf-8", "replace")
                rec.error = f"http_{resp.status}: {detail}"
                return
            done = False
            async for now, payloads in sse_data(resp.content):
                for data in payloads:
                    if data == b"[DONE]":
                        done = True
                        break
                    event = _decode_event(data)
                    if event.error is not None and not event.choices:
                        rec.error = f"stream_error: {str(event.error)[:160]}"
                        return
                    for choice in event.choices or ():
                        text = choice.delta.content if choice.delta else None
                        if text:
                            rec.first = rec.first or now
                            parts.append(text)
                        rec.finish_reason = choice.finish_reason or rec.finish_reason
                    usage = event.usage or usage
                if done:
                    break
    except msgspec.DecodeError as e:
        rec.error = f"bad_json: {e}"[:200]
    except TimeoutError as e:
        rec.error = f"timeout: {type(e).__name__}"
    except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as e:
        rec.error = f"connection: {type(e).__name__} {e}"[:200]
    finally:
        rec.end = time.perf_counter()
        rec.reply = "".join(parts)
    if rec.error is None and usage is not None:
        rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens = usage_tokens(usage)
    if rec.error is None and rec.first is None:
        rec.error = "empty: no content chunks"


@dataclass(slots=True)
class Target:
    """Where and how the turns are sent."""

    url: str
    model: str
    max_tokens: int
    ignore_eos: bool


class Session:
    """One agent: its trace index, the replies it got, a record per turn sent."""

    def __init__(self, trace: Trace, index: int) -> None:
        self.trace = trace
        self.index = index
        self.records: list[TurnRecord] = []

    @property
    def failed(self) -> bool:
        return any(not r.ok for r in self.records)

    async def turn(self, client: aiohttp.ClientSession, target: Target) -> None:
        replies = [r.reply for r in self.records]
        messages = self.trace.messages(self.index, replies)
        body = chat_body(target.model, messages, target.max_tokens, target.ignore_eos)
        rec = TurnRecord(self.index, len(replies) + 1)
        self.records.append(rec)
        await send_turn(client, target.url, body, rec)

    async def run(self, client: aiohttp.ClientSession, target: Target) -> None:
        for _ in range(self.trace.turns):
            await self.turn(client, target)
            if self.failed:
                return


async def run_sessions(
    client: aiohttp.ClientSession,
    target: Target,
    trace: Trace,
    lockstep: bool = True,
    shares: list[dict[str, float]] | None = None,
) -> list[list[TurnRecord]]:
    """Every session of ``trace`` through all its turns; records per session. In lockstep,
    ``shares`` (a list given) gets each turn's account of the gateway's (its /metrics
    around the turn: where the first tokens waited in the worker, ``_client.GATEWAY_MEANS``;
    an empty dict from a server without them)."""
    sessions = [Session(trace, s) for s in range(trace.sessions)]
    if lockstep:
        for _ in range(trace.turns):
            live = [s for s in sessions if not s.failed]
            before = (
                await _client.gateway_account(client, target.url) if shares is not None else None
            )
            await asyncio.gather(*(s.turn(client, target) for s in live))
            if shares is not None:
                after = await _client.gateway_account(client, target.url)
                shares.append(_client.gateway_means(before, after))
    else:
        await asyncio.gather(*(s.run(client, target) for s in sessions))
    return [s.records for s in sessions]
