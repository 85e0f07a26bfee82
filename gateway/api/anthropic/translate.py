"""Pure translation between Anthropic Messages bodies and the canonical types. No I/O here."""

from __future__ import annotations

import json
import uuid
from typing import Any, TypeVar

import msgspec

from gateway.api.anthropic.errors import error_json
from gateway.api.anthropic.schemas import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensBody,
    DeltaUsage,
    ImageBlock,
    MessageBody,
    MessageDelta,
    MessageParam,
    MessagesRequest,
    MessageStart,
    MessageStop,
    Ping,
    PromptFields,
    StopDelta,
    TextBlock,
    TextContent,
    TextDelta,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    UsageBody,
)
from gateway.api.common import (
    Unserved,
    image_bytes,
    image_from_url,
    invalid,
    media_parts,
    sampling,
    text_of,
)
from gateway.api.relay import Choice, sse_event
from gateway.errors import GatewayError, validation_error
from shared.types import (
    CanonicalRequest,
    FinishReason,
    ImagePart,
    Message,
    RequestOutput,
    SamplingParams,
    TextPart,
    ToolCall,
    Usage,
)
from shared.types import ContentPart as Part

T = TypeVar("T")

MESSAGES_PATH = "/v1/messages"  # error bodies in Anthropic's shape

# Content block types Anthropic documents that have no place in the neutral message, and why.
_BLOCKS_NOT_SERVED = {
    "document": "document input is not served",
    "search_result": "search results are not served",
    "server_tool_use": "server tools are not served",
    "web_search_tool_result": "server tools are not served",
    "redacted_thinking": "extended thinking is not served",
    "container_upload": "containers are not served",
}
# Blocks the neutral message carries, and why a text model does not serve them yet.
_NOT_SERVED_YET = {
    "image": ("image", "image input is not served by text models"),
    "tool_use": ("tool_calls", "tool use is not served yet"),
    "tool_result": ("tool_result", "tool use is not served yet"),
    "thinking": ("reasoning", "extended thinking is not served"),
}


def _convert(block: dict[str, Any], type_: type[T], where: str) -> T:
    try:
        return msgspec.convert(block, type_)
    except msgspec.ValidationError as exc:
        raise validation_error(exc, where) from exc


def _image(block: dict[str, Any], where: str) -> ImagePart:
    source = _convert(block, ImageBlock, where).source
    if source.type == "url":
        if not source.url:
            raise invalid(f"`{where}.source` of type 'url' needs `url`", f"{where}.source.url")
        return image_from_url(source.url, f"{where}.source.url")
    if source.data is None or source.media_type is None:
        raise invalid(
            f"`{where}.source` of type 'base64' needs `media_type` and `data`", f"{where}.source"
        )
    return ImagePart(image_bytes(source.data, f"{where}.source.data"), source.media_type)


class _Turn:
    """One Anthropic message as neutral messages: its tool results (each a `tool` message),
    then the rest of its content."""

    def __init__(self, role: str, unserved: Unserved) -> None:
        self.role = role
        self.unserved = unserved
        self.parts: list[Part] = []
        self.calls: list[ToolCall] = []
        self.reasoning: list[str] = []
        self.results: list[Message] = []

    def block(self, where: str, block: dict[str, Any]) -> None:
        kind = block.get("type")
        if not isinstance(kind, str):
            raise invalid(f"`{where}` needs a string `type`", f"{where}.type")
        if kind == "text":
            self.parts.append(TextPart(_convert(block, TextBlock, where).text))
            return
        if kind not in _NOT_SERVED_YET:
            why = _BLOCKS_NOT_SERVED.get(kind, "only text content blocks are served")
            raise invalid(f"`{where}` is a content block of type {kind!r}: {why}", where)
        if kind == "image":
            self.parts.append(_image(block, where))
        elif kind == "tool_use":
            use = _convert(block, ToolUseBlock, where)
            self.calls.append(ToolCall(use.id, use.name, json.dumps(use.input)))
        elif kind == "tool_result":
            result = _convert(block, ToolResultBlock, where)
            inner = _Turn("tool", self.unserved)
            if isinstance(result.content, str):
                inner.parts.append(TextPart(result.content))
            else:
                for j, sub in enumerate(result.content):
                    inner.block(f"{where}.content[{j}]", sub)
            self.results.append(inner.message(tool_call_id=result.tool_use_id))
        else:
            self.reasoning.append(_convert(block, ThinkingBlock, where).thinking)
        feature, why = _NOT_SERVED_YET[kind]
        error = invalid(f"`{where}` is a content block of type {kind!r}: {why}", where)
        self.unserved.add(feature, error)

    def message(self, tool_call_id: str | None = None) -> Message:
        return Message(
            role=self.role,
            content=text_of(self.parts),
            parts=media_parts(self.parts),
            tool_calls=self.calls,
            tool_call_id=tool_call_id,
            reasoning="".join(self.reasoning) if self.reasoning else None,
        )

    def messages(self) -> list[Message]:
        rest = self.parts or self.calls or self.reasoning or not self.results
        return self.results + ([self.message()] if rest else [])


def _messages(index: int, message: MessageParam, unserved: Unserved) -> list[Message]:
    if isinstance(message.content, str):
        return [Message(role=message.role, content=message.content)]
    turn = _Turn(message.role, unserved)
    where = f"messages[{index}].content"
    for j, block in enumerate(message.content):
        turn.block(f"{where}[{j}]", block)
    return turn.messages()


def _system(system: str | list[TextBlock] | None) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    return "".join(block.text for block in system)


def _refuse_unserved(req: PromptFields) -> None:
    if req.tools:
        raise invalid("`tools`: tool use is not served yet", "tools")
    if req.tool_choice is not None and req.tool_choice.get("type") not in ("auto", "none"):
        raise invalid("`tool_choice`: tool use is not served yet", "tool_choice")
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        raise invalid(
            '`thinking`: extended thinking is not served; only {"type": "disabled"}', "thinking"
        )


def prompt_request(req: PromptFields) -> CanonicalRequest:
    """The chat request the messages (and system prompt) make. A last assistant message is
    a prefill: the model continues it (an empty one is no prefill: a new assistant turn)."""
    _refuse_unserved(req)
    if not req.messages:
        raise invalid("`messages` must not be empty", "messages")
    unserved = Unserved()
    messages = [msg for i, m in enumerate(req.messages) for msg in _messages(i, m, unserved)]
    unserved.refuse()
    last = messages[-1]
    if len(messages) > 1 and last.role == "assistant" and not last.content and not last.extras():
        messages.pop()
    system = _system(req.system)
    if system:
        messages.insert(0, Message(role="system", content=system))
    if messages[-1].role == "assistant":
        return CanonicalRequest(
            messages=messages,
            add_generation_prompt=False,
            chat_template_kwargs={"continue_final_message": True},
        )
    return CanonicalRequest(messages=messages)


def _stop_sequences(stops: list[str] | None) -> list[str]:
    if stops and any(not text for text in stops):
        raise invalid("stop_sequences must not contain an empty string", "stop_sequences")
    return list(stops or [])


def messages_request(req: MessagesRequest) -> tuple[CanonicalRequest, SamplingParams]:
    canonical = prompt_request(req)
    params = sampling(
        req.max_tokens,
        req.temperature,
        req.top_p,
        req.top_k,
        stop=_stop_sequences(req.stop_sequences),
    )
    return canonical, params


# ---- responses ---------------------------------------------------------------------------


def stop_reason(reason: FinishReason | None, stop: str | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence): EOS is end_turn, a matched stop string stop_sequence."""
    if reason == FinishReason.STOP:
        return ("stop_sequence", stop) if stop is not None else ("end_turn", None)
    if reason == FinishReason.LENGTH:
        return "max_tokens", None
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


class MessagesFormatter:
    """Builds one Messages response: a message body, or its stream of named SSE events."""

    def __init__(self, model: str) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.encode = msgspec.json.Encoder().encode

    def _event(self, name: str, body: msgspec.Struct) -> bytes:
        return sse_event(name, self.encode(body))

    def _message(
        self, text: str | None, reason: tuple[str | None, str | None], usage: UsageBody
    ) -> MessageBody:
        content = [] if text is None else [TextContent(text=text)]
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
        start = self._message(None, (None, None), usage_body(usage))
        return (
            self._event("message_start", MessageStart(start))
            + self._event("content_block_start", ContentBlockStart(0, TextContent(text="")))
            + self._event("ping", Ping())
        )

    def stream_delta(self, index: int, output: RequestOutput) -> bytes:
        if not output.text:
            return b""
        return self._event("content_block_delta", ContentBlockDelta(0, TextDelta(output.text)))

    def stream_finish(self, index: int, output: RequestOutput) -> bytes:
        reason, sequence = stop_reason(output.finish_reason, output.stop)
        return self._event("content_block_stop", ContentBlockStop(0)) + self._event(
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
            choice.text,
            stop_reason(choice.finish_reason, choice.stop),
            usage_body(usage),
        )
        return self.encode(body)
