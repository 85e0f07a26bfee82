"""Anthropic Messages request and response bodies as msgspec Structs.

Requests forbid unknown fields, so a parameter this gateway does not implement is a 400 naming
it, never silently ignored. Message content blocks and tool definitions are decoded as plain
objects and checked one by one in translate, so that a block or tool of a type not served is a
400 naming its position.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

PosInt = Annotated[int, Meta(ge=1, le=2**31 - 1)]
# Anthropic documents temperature in [0, 1]; top_p 0 would turn the filter off here, not on.
Temperature = Annotated[float, Meta(ge=0.0, le=1.0)]
# Stop sequences are checked at every token: their number and length are bounded
StopSequences = Annotated[list[Annotated[str, Meta(max_length=1024)]], Meta(max_length=16)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=0, le=2**31 - 1)]


class _Body(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class TextBlock(_Body):
    """A `text` content block of a request (in `system`, or in a message's content)."""

    type: Literal["text"]
    text: str
    # A prompt-caching breakpoint: the worker reuses common prefixes by itself, so accepted
    # and ignored.
    cache_control: dict[str, Any] | None = None
    # Citations of an earlier response's text block, sent back in a conversation: ignored.
    citations: list[Any] | None = None


class ImageSource(_Body):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(_Body):
    type: Literal["image"]
    source: ImageSource
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(_Body):
    """An assistant's call, sent back in the history."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    # Sent back as the SDK received them (None for a direct call): a call made from a
    # code-execution tool (a caller of another type) is refused by the translator.
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class MessageParam(_Body):
    # "system": instructions in the conversation (Claude Code sends its agents and skills
    # so): added to the system prompt, in order
    role: Literal["user", "assistant", "system"]
    # A string, or a list of content blocks (checked one by one in translate).
    content: str | list[dict[str, Any]]


class ToolDef(_Body):
    """A client tool: the model calls it, the client runs it (server tools have other
    `type`s and are refused in translate)."""

    name: str
    input_schema: dict[str, Any]
    description: str = ""
    type: Literal["custom"] | None = None
    strict: bool = False
    cache_control: dict[str, Any] | None = None  # a caching breakpoint: ignored, as on blocks


# tool_choice, by its `type`
class ToolChoiceAuto(_Body, tag="auto", tag_field="type"):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Body, tag="any", tag_field="type"):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Body, tag="tool", tag_field="type"):
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Body, tag="none", tag_field="type"):
    pass


ToolChoiceParam = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


# thinking, by its `type`; `display` "omitted" sends thinking blocks without their text
ThinkingDisplay = Literal["summarized", "omitted"]


class ThinkingEnabled(_Body, tag="enabled", tag_field="type"):
    # Anthropic asks for at least 1024; any positive budget is served (small local models).
    budget_tokens: PosInt
    display: ThinkingDisplay | None = None


class ThinkingAdaptive(_Body, tag="adaptive", tag_field="type"):
    display: ThinkingDisplay | None = None


class ThinkingDisabled(_Body, tag="disabled", tag_field="type"):
    pass


ThinkingParam = ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled


class Metadata(_Body):
    user_id: str | None = None  # an opaque end-user id: accepted, not used


class ThinkingTurns(_Body, tag="thinking_turns", tag_field="type"):
    value: PosInt


class ClearThinking(_Body, tag="clear_thinking_20251015", tag_field="type"):
    """Context editing: the thinking of all but the last `keep` assistant turns is left
    out of the prompt ("all": none is; Anthropic's default: the last turn's is kept)."""

    keep: Literal["all"] | ThinkingTurns = msgspec.field(default_factory=lambda: ThinkingTurns(1))


class ContextManagement(_Body):
    # each checked in translate: clear_thinking_20251015 is served, other edits are a 400
    edits: list[dict[str, Any]] = []


class OutputConfig(_Body):
    """`effort` (guidance: reaches templates that take an effort level, as "high" for
    "xhigh" and "max", their highest) and `format` (a JSON schema the answer follows)."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict[str, Any] | None = None


class PromptFields(_Body):
    """Fields shared by /v1/messages and /v1/messages/count_tokens."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None  # ToolDef each, or a server tool (refused)
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    # Automatic prompt caching's request-level breakpoint: accepted and ignored, as on blocks.
    cache_control: dict[str, Any] | None = None
    context_management: ContextManagement | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(PromptFields, kw_only=True):
    max_tokens: PosInt  # required, as in Anthropic's API
    stop_sequences: StopSequences | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    metadata: Metadata | None = None
    stream: bool = False
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here


class CountTokensRequest(PromptFields):
    pass


# ---- responses --------------------------------------------------------------------------


class TextContent(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ThinkingContent(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""  # no signature: nothing here is encrypted or verified


class ToolUseContent(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextContent | ThinkingContent | ToolUseContent


class UsageBody(msgspec.Struct):
    """Anthropic's split: `input_tokens` is the input NOT read from the prefix cache, so the
    prompt is input_tokens + cache_creation_input_tokens + cache_read_input_tokens (the cache
    is automatic: nothing is ever written to it on request, creation is always 0)."""

    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int


class MessageBody(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: UsageBody


class CountTokensBody(msgspec.Struct):
    input_tokens: int


# Streaming events: each has a `type`, the same as its SSE event name.


class MessageStart(msgspec.Struct, tag="message_start", tag_field="type"):
    message: MessageBody


class ContentBlockStart(msgspec.Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: ContentBlock


class Ping(msgspec.Struct, tag="ping", tag_field="type"):
    pass


class TextDelta(msgspec.Struct, tag="text_delta", tag_field="type"):
    text: str


class ThinkingDelta(msgspec.Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class SignatureDelta(msgspec.Struct, tag="signature_delta", tag_field="type"):
    signature: str


class InputJsonDelta(msgspec.Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str


BlockDelta = TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class ContentBlockDelta(msgspec.Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: BlockDelta


class ContentBlockStop(msgspec.Struct, tag="content_block_stop", tag_field="type"):
    index: int


class StopDelta(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class DeltaUsage(msgspec.Struct, omit_defaults=True):
    """Cumulative counts at the end; the input fields repeat message_start's split, final."""

    output_tokens: int
    input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class MessageDelta(msgspec.Struct, tag="message_delta", tag_field="type"):
    delta: StopDelta
    usage: DeltaUsage


class MessageStop(msgspec.Struct, tag="message_stop", tag_field="type"):
    pass


class ErrorDetail(msgspec.Struct):
    type: str
    message: str


class ErrorBody(msgspec.Struct, tag="error", tag_field="type"):
    """Anthropic's error body: {"type": "error", "error": {"type": ..., "message": ...}}."""

    error: ErrorDetail
