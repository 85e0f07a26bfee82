"""Pure translation between Anthropic Messages bodies and the canonical types. No I/O here."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from gateway.api.anthropic.errors import error_json
from gateway.api.anthropic.schemas import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensBody,
    DeltaUsage,
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
    UsageBody,
)
from gateway.api.common import invalid, sampling
from gateway.api.relay import Choice, sse_event
from gateway.errors import GatewayError, validation_error
from shared.types import (
    CanonicalRequest,
    FinishReason,
    Message,
    RequestOutput,
    SamplingParams,
    Usage,
)

MESSAGES_PATH = "/v1/messages"  # error bodies in Anthropic's shape

# Content block types Anthropic documents that this gateway does not serve, and why.
_BLOCKS_NOT_SERVED = {
    "image": "image input is not served",
    "document": "document input is not served",
    "search_result": "search results are not served",
    "tool_use": "tool use is not served yet",
    "tool_result": "tool use is not served yet",
    "server_tool_use": "server tools are not served",
    "web_search_tool_result": "server tools are not served",
    "thinking": "extended thinking is not served",
    "redacted_thinking": "extended thinking is not served",
    "container_upload": "containers are not served",
}


def _block_text(where: str, block: dict[str, Any]) -> str:
    """The text of one content block (`where` names it: messages[i].content[j])."""
    kind = block.get("type")
    if kind != "text":
        if not isinstance(kind, str):
            raise invalid(f"`{where}` needs a string `type`", f"{where}.type")
        why = _BLOCKS_NOT_SERVED.get(kind, "only text content blocks are served")
        raise invalid(f"`{where}` is a content block of type {kind!r}: {why}", where)
    try:
        return msgspec.convert(block, TextBlock).text
    except msgspec.ValidationError as exc:
        raise validation_error(exc, where) from exc


def _content(index: int, message: MessageParam) -> str:
    if isinstance(message.content, str):
        return message.content
    where = f"messages[{index}].content"
    return "".join(_block_text(f"{where}[{j}]", b) for j, b in enumerate(message.content))


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
    messages = [Message(role=m.role, content=_content(i, m)) for i, m in enumerate(req.messages)]
    if len(messages) > 1 and messages[-1].role == "assistant" and not messages[-1].content:
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
