"""OpenAI Responses API bodies as msgspec Structs.

The request forbids unknown fields, so a parameter this gateway does not implement is a 400
naming it. Input items, tools and `text.format` are decoded loosely (as JSON objects) and
checked one by one in `translate` and `options`, so that an unsupported item, part or tool
is a 400 naming `input[i]...` / `tools[i]...`.

A conversation is a list of items (messages, function calls, their outputs, reasoning): a
response's input, stored, and its output. Items are untagged Structs whose `type` field is
written where OpenAI writes it; they are only ever encoded.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

PosInt = Annotated[int, Meta(ge=1, le=2**31 - 1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MetadataKey = Annotated[str, Meta(max_length=64)]
MetadataValue = Annotated[str, Meta(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Meta(max_length=16)]


class _Body(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


# ---- requests ----------------------------------------------------------------------------


class TextConfig(_Body):
    format: dict[str, Any] | None = None  # text, json_object or json_schema (see options)


class JsonSchemaFormatIn(_Body):
    """`text.format` of type json_schema."""

    type: Literal["json_schema"]
    name: str
    schema: dict[str, Any]
    strict: bool | None = None
    description: str | None = None


class FunctionToolIn(_Body):
    """One entry of `tools`: a function the model may call."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


Effort = Literal["none", "minimal", "low", "medium", "high"]
Summary = Literal["auto", "concise", "detailed"]


class ReasoningConfig(_Body):
    """`reasoning`: an effort level; a summary is accepted (the reasoning text itself is
    returned: the gateway has nothing to summarize it with)."""

    effort: Effort | None = None
    summary: Summary | None = None
    generate_summary: Summary | None = None  # the older name of `summary`


class StreamOptions(_Body):
    include_obfuscation: bool | None = None  # accepted; no padding is ever added


class ResponsesRequest(_Body):
    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: PosInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    # optional in OpenAI's SDKs: a null is the default
    stream_given: bool | None = msgspec.field(default=None, name="stream")
    stream_options: StreamOptions | None = None
    store_given: bool | None = msgspec.field(default=None, name="store")  # null: true
    background_given: bool | None = msgspec.field(default=None, name="background")
    metadata: Metadata | None = None
    user: str | None = None  # an end-user id: echoed
    safety_identifier: str | None = None  # likewise
    prompt_cache_key: str | None = None  # a caching hint: prefix reuse needs none
    # a client's own tracing data (Codex sends its ids with every turn): nothing to serve
    client_metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None  # one tier here
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    text: TextConfig | None = None
    parallel_tool_calls: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None  # reasoning.encrypted_content only (else a 400)
    # Documented fields this gateway cannot honour (beyond their empty values): a 400 each.
    top_logprobs: Any | None = None
    conversation: Any | None = None
    prompt: Any | None = None

    @property
    def stream(self) -> bool:
        return bool(self.stream_given)

    @property
    def store(self) -> bool:
        return self.store_given is not False

    @property
    def background(self) -> bool:
        return bool(self.background_given)


class MessageItemIn(_Body):
    """One input item of type "message" (EasyInputMessage, or an earlier output passed back)."""

    role: str
    content: str | list[dict[str, Any]]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None  # an assistant message's label: accepted, not used
    end_turn: bool | None = None  # (Codex keeps it on messages it sends back): likewise


class ImagePartIn(_Body):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    # "original": Codex's own (full resolution), taken as "high"
    detail: Literal["auto", "low", "high", "original"] | None = None


class FunctionCallIn(_Body):
    """A call the model made, passed back in the input."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputIn(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class ReasoningIn(_Body):
    """A reasoning item passed back: its reasoning text, or else the text its
    `encrypted_content` holds (one this gateway made), or else its summary texts."""

    type: Literal["reasoning"]
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    id: str | None = None
    encrypted_content: str | None = None
    status: str | None = None


class TextPartIn(_Body):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier output passed back
    logprobs: list[Any] | None = None


# ---- items -------------------------------------------------------------------------------


class InputText(msgspec.Struct, tag_field="type", tag="input_text"):
    text: str


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []


class InputImage(msgspec.Struct, tag_field="type", tag="input_image"):
    """An image of an input message, as the client gave it (an http(s) or data URL)."""

    image_url: str
    detail: str = "auto"


ContentPart = InputText | OutputText | InputImage


class MessageItem(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    """A message of a conversation: an input item, or the assistant's output."""

    id: str
    status: str = "completed"  # in_progress | completed | incomplete
    role: str
    content: list[ContentPart]


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class SummaryText(msgspec.Struct, tag_field="type", tag="summary_text"):
    text: str


class ReasoningItem(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning"):
    """The model's thinking: its text in `content` (never summarized here); with `include`
    reasoning.encrypted_content, that text sealed too (translate.seal), for a client that
    keeps no state on the server to pass back."""

    id: str
    status: str = "completed"
    summary: list[SummaryText] = []
    content: list[ReasoningText] = []
    encrypted_content: str | msgspec.UnsetType = msgspec.UNSET


class FunctionCallItem(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    """A call the model made: `arguments` is its arguments' JSON text."""

    id: str
    status: str = "completed"
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(
    msgspec.Struct, kw_only=True, tag_field="type", tag="function_call_output"
):
    """A call's result, as the client sent it: its text, or its parts where it holds
    images (a screenshot a tool took, say)."""

    id: str
    status: str = "completed"
    call_id: str
    output: str | list[InputText | InputImage]


OutputItem = MessageItem | ReasoningItem | FunctionCallItem
Item = MessageItem | ReasoningItem | FunctionCallItem | FunctionCallOutputItem


# ---- the response object -------------------------------------------------------------------


class ResponseError(msgspec.Struct):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct):
    reason: str


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    # OpenAI's SDK requires it; the prefix cache is filled by itself, never on request
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


def _plain_text() -> dict[str, Any]:
    return {"type": "text"}


class TextOut(msgspec.Struct):
    format: dict[str, Any] = msgspec.field(default_factory=_plain_text)


class ResponseObject(msgspec.Struct, kw_only=True):
    """A response: its status, its output items and its usage (OpenAI's Response)."""

    # mutable: a background response evolves in the store

    id: str
    object: str = "response"
    created_at: int
    status: str  # queued | in_progress | completed | incomplete | failed | cancelled
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] = {}
    model: str
    output: list[OutputItem] = []
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str = "default"
    store: bool = True
    temperature: float = 1.0
    text: TextOut = msgspec.field(default_factory=TextOut)
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[Any] = []
    top_p: float = 1.0
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    completed_at: int | None = None


class DeletedResponse(msgspec.Struct):
    id: str
    object: str = "response.deleted"
    deleted: bool = True


class ItemList(msgspec.Struct):
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"
