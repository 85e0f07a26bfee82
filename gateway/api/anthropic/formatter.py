"""Anthropic Messages responses from the worker's deltas: a message body, or its stream of
named SSE events. Content comes as blocks, in order: thinking, text, then one tool_use block
per call. Pure: no I/O here."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from gateway.api.anthropic.errors import error_json
from gateway.api.anthropic.schemas import (
    BlockDelta,
    ContentBlock,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensBody,
    DeltaUsage,
    InputJsonDelta,
    MessageBody,
    MessageDelta,
    MessageStart,
    MessageStop,
    Ping,
    SignatureDelta,
    StopDelta,
    TextContent,
    TextDelta,
    ThinkingContent,
    ThinkingDelta,
    ToolUseContent,
    UsageBody,
)
from gateway.api.relay import Choice, sse_event
from gateway.errors import GatewayError
from shared.types import FinishReason, RequestOutput, ToolCallDelta, Usage


def stop_reason(reason: FinishReason | None, stop: str | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence): EOS is end_turn, a matched stop string stop_sequence."""
    if reason == FinishReason.STOP:
        return ("stop_sequence", stop) if stop is not None else ("end_turn", None)
    if reason == FinishReason.LENGTH:
        return "max_tokens", None
    if reason == FinishReason.TOOL_CALLS:
        return "tool_use", None
    return None, None


def usage_body(usage: Usage) -> UsageBody:
    """The prompt split as Anthropic counts it: tokens read from the cache are not input."""
    cached = min(usage.cached_tokens, usage.prompt_tokens)
    return UsageBody(
        input_tokens=usage.prompt_tokens - cached,
        cache_creation_input_tokens=0,
        cache_read_input_tokens=cached,
        output_tokens=usage.completion_tokens,
    )


def delta_usage(usage: Usage | None) -> DeltaUsage:
    if usage is None:
        return DeltaUsage(0)
    body = usage_body(usage)
    return DeltaUsage(
        body.output_tokens,
        body.input_tokens,
        body.cache_creation_input_tokens,
        body.cache_read_input_tokens,
    )


def count_tokens_body(count: int) -> bytes:
    return msgspec.json.encode(CountTokensBody(count))


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as its `input` object: {} when they are not a JSON object (cut
    short by max_tokens, say)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_of(choice: Choice, show_thinking: bool = True) -> list[ContentBlock]:
    """A whole answer's blocks. The text block is left out only when it is empty and the
    model called tools."""
    blocks: list[ContentBlock] = []
    if choice.reasoning:
        blocks.append(ThinkingContent(choice.reasoning if show_thinking else ""))
    if choice.text or not choice.tool_calls:
        blocks.append(TextContent(choice.text))
    blocks += [ToolUseContent(c.id, c.name, tool_input(c.arguments)) for c in choice.tool_calls]
    return blocks


class StreamedBlocks:
    """A streamed message's content blocks as events. A block starts with its first piece
    and stops when a piece of another kind (or another call) comes, or the message ends."""

    def __init__(self, event: Callable[[str, msgspec.Struct], bytes], show_thinking: bool) -> None:
        self.event = event
        self.show_thinking = show_thinking
        self.index = -1  # the open block's (or the last one's)
        self.open: str | None = None  # the open block's type
        self.had_text = False
        self.calls: dict[int, int] = {}  # a call's index in the turn -> its block's index

    def start(self, kind: str, block: ContentBlock) -> bytes:
        out = self.stop()
        self.index += 1
        self.open = kind
        self.had_text = self.had_text or kind == "text"
        return out + self.event("content_block_start", ContentBlockStart(self.index, block))

    def _delta(self, index: int, delta: BlockDelta) -> bytes:
        return self.event("content_block_delta", ContentBlockDelta(index, delta))

    def stop(self) -> bytes:
        if self.open is None:
            return b""
        # A thinking block ends with its signature: none here, nothing is signed.
        out = self._delta(self.index, SignatureDelta("")) if self.open == "thinking" else b""
        self.open = None
        return out + self.event("content_block_stop", ContentBlockStop(self.index))

    def thinking(self, text: str) -> bytes:
        out = b"" if self.open == "thinking" else self.start("thinking", ThinkingContent(""))
        return out + (self._delta(self.index, ThinkingDelta(text)) if self.show_thinking else b"")

    def text(self, text: str) -> bytes:
        out = b"" if self.open == "text" else self.start("text", TextContent(""))
        return out + self._delta(self.index, TextDelta(text))

    def tool_call(self, call: ToolCallDelta) -> bytes:
        out = b""
        if call.index not in self.calls:  # its first delta: id and name
            out = self.start("tool_use", ToolUseContent(call.id, call.name, {}))
            self.calls[call.index] = self.index
        if call.arguments:
            out += self._delta(self.calls[call.index], InputJsonDelta(call.arguments))
        return out

    def end(self) -> bytes:
        """Stops the open block. A message with neither text nor calls gets an empty text
        block, as its non-streamed body has."""
        out = b""
        if not self.had_text and not self.calls:
            out = self.start("text", TextContent(""))
        return out + self.stop()


class MessagesFormatter:
    """Builds one Messages response: a message body, or its stream of named SSE events.

    A stream opens its text block with message_start (`text_first`), as it always has for
    plain text; a request whose answer may begin with thinking or a tool call opens each
    block when its first piece comes instead, so no empty text block comes first. With
    `show_thinking` False (thinking `display: "omitted"`) thinking blocks carry no text.
    """

    def __init__(self, model: str, text_first: bool = True, show_thinking: bool = True) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.text_first = text_first
        self.show_thinking = show_thinking
        self.encode = msgspec.json.Encoder().encode
        self.blocks = StreamedBlocks(self._event, show_thinking)

    def _event(self, name: str, body: msgspec.Struct) -> bytes:
        return sse_event(name, self.encode(body))

    def _message(
        self,
        content: list[ContentBlock],
        reason: tuple[str | None, str | None],
        usage: UsageBody,
    ) -> MessageBody:
        return MessageBody(
            id=self.id,
            model=self.model,
            content=content,
            stop_reason=reason[0],
            stop_sequence=reason[1],
            usage=usage,
        )

    def stream_start(self, first: RequestOutput) -> bytes:
        usage = first.usage or Usage()
        usage = msgspec.structs.replace(usage, completion_tokens=min(1, usage.completion_tokens))
        start = self._message([], (None, None), usage_body(usage))
        out = self._event("message_start", MessageStart(start))
        if self.text_first:
            out += self.blocks.start("text", TextContent(""))
        return out + self._event("ping", Ping())

    def stream_delta(self, index: int, output: RequestOutput) -> bytes:
        """Thinking, then the rest of a call already open, then text, then new calls: a
        delta merged for a slow reader may hold a call's last fragment and the text after
        it, and a fragment must reach its block before that block is stopped."""
        out = self.blocks.thinking(output.reasoning) if output.reasoning else b""
        started = [c for c in output.tool_calls if c.index in self.blocks.calls]
        for call in started:
            out += self.blocks.tool_call(call)
        if output.text:
            out += self.blocks.text(output.text)
        for call in output.tool_calls[len(started) :]:
            out += self.blocks.tool_call(call)
        return out

    def stream_finish(self, index: int, output: RequestOutput) -> bytes:
        reason, sequence = stop_reason(output.finish_reason, output.stop)
        return self.blocks.end() + self._event(
            "message_delta",
            MessageDelta(StopDelta(reason, sequence), delta_usage(output.usage)),
        )

    def stream_end(self, usage: Usage) -> bytes:
        return self._event("message_stop", MessageStop())

    def stream_error(self, error: GatewayError) -> bytes:
        return sse_event("error", error_json(error))

    def response(self, choices: list[Choice], usage: Usage) -> bytes:
        choice = choices[0]
        body = self._message(
            content_of(choice, self.show_thinking),
            stop_reason(choice.finish_reason, choice.stop),
            usage_body(usage),
        )
        return self.encode(body)
