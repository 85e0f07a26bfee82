"""Pure translation between Responses API bodies and the canonical types. No I/O here.

A response's conversation is a list of MessageItems: the history it was chained onto (the
previous response's conversation and output), then its own input. `instructions` become a
system message first and are never carried to a chained response (as OpenAI documents).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from gateway.api.common import Unserved, image_from_url, invalid, sampling, unsupported
from gateway.api.relay import Choice, sse_event
from gateway.api.responses.schemas import (
    FunctionCallIn,
    FunctionCallOutputIn,
    ImagePartIn,
    IncompleteDetails,
    InputText,
    InputTokensDetails,
    ItemList,
    MessageItem,
    MessageItemIn,
    OutputText,
    OutputTokensDetails,
    ReasoningIn,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextPartIn,
)
from gateway.errors import GatewayError, validation_error
from shared.types import (
    CanonicalRequest,
    FinishReason,
    ImagePart,
    Message,
    RequestOutput,
    SamplingParams,
    ToolCall,
    Usage,
)

ROLES = ("user", "assistant", "system", "developer")
# Statuses of a response whose generation has not ended (background mode).
RUNNING = ("queued", "in_progress")
T = TypeVar("T")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- requests ----------------------------------------------------------------------------


def check_request(body: ResponsesRequest) -> None:
    """Every documented field this gateway cannot honour is a 400 naming it."""
    if body.tools:
        raise unsupported("tools", "tool calling is not served yet")
    if body.tool_choice not in (None, "none", "auto"):
        raise unsupported("tool_choice", "tool calling is not served yet")
    if _set(body.reasoning):
        raise unsupported("reasoning", "this gateway has no reasoning controls")
    if body.include:
        raise unsupported("include", "no extra output data is served")
    if body.top_logprobs:
        raise unsupported("top_logprobs", "logprobs are not served on the Responses API yet")
    if body.truncation == "auto":
        raise unsupported("truncation", "'auto' is not served; only 'disabled'")
    if body.text is not None and body.text.format is not None and body.text.format.type != "text":
        raise unsupported(
            "text.format",
            f"type {body.text.format.type!r}: structured output is not served yet",
        )
    if body.conversation is not None:
        raise unsupported("conversation", "conversations are not served; use previous_response_id")
    if body.prompt is not None:
        raise unsupported("prompt", "prompt templates are not served")
    if body.background and body.stream:
        raise unsupported("background", "background responses cannot be streamed here")
    if body.background and not body.store:
        raise invalid("background responses must be stored: `store` false is refused", "store")
    if body.input is None:
        raise invalid("`input` is required", "input")
    if isinstance(body.input, list) and not body.input:
        raise invalid("`input` must not be empty", "input")


def _set(value: Any) -> bool:
    """Anything but an empty value (None, {}, a dict of Nones) asks for something."""
    if isinstance(value, dict):
        return any(v is not None for v in value.values())
    return value is not None


def _convert(value: Any, type_: type[T], where: str) -> T:
    """msgspec.convert, with a failure as a 400 naming the path below `where`."""
    try:
        return msgspec.convert(value, type_)
    except msgspec.ValidationError as exc:
        raise validation_error(exc, where) from None


def input_items(
    body_input: str | list[dict[str, Any]], unserved: Unserved | None = None
) -> list[MessageItem]:
    """The request's own input as conversation items (a string is one user message). Items
    and parts the neutral model carries but no worker serves yet (images, function calls
    and their outputs, reasoning) are mapped and recorded in `unserved` (None: refused)."""
    uses = unserved if unserved is not None else Unserved()
    if isinstance(body_input, str):
        return [MessageItem(id=new_id("msg"), role="user", content=[InputText(body_input)])]
    items = []
    for i, raw in enumerate(body_input):
        where = f"input[{i}]"
        kind = raw.get("type", "message")
        if kind in _ITEMS_NOT_SERVED_YET:
            item_message(raw, where, uses)
            continue
        if kind != "message":
            raise invalid(
                f"`{where}.type` {kind!r} is not supported: only message, function_call, "
                "function_call_output and reasoning items are served",
                f"{where}.type",
            )
        item = _convert(raw, MessageItemIn, where)
        if item.role not in ROLES:
            raise invalid(
                f"`{where}.role` {item.role!r} is not supported (one of {', '.join(ROLES)})",
                f"{where}.role",
            )
        items.append(_message_item(item, where, uses))
    if unserved is None:
        uses.refuse()
    return items


# Item types the neutral message carries, and why a text model does not serve them yet.
_ITEMS_NOT_SERVED_YET = {
    "function_call": ("tool_calls", "tool calling is not served yet"),
    "function_call_output": ("tool_result", "tool calling is not served yet"),
    "reasoning": ("reasoning", "reasoning items are not served yet"),
}


def item_message(raw: dict[str, Any], where: str, unserved: Unserved) -> Message:
    """A function_call, function_call_output or reasoning item as a neutral message."""
    kind = raw["type"]
    if kind == "function_call":
        call = _convert(raw, FunctionCallIn, where)
        message = Message(
            "assistant", tool_calls=[ToolCall(call.call_id, call.name, call.arguments)]
        )
    elif kind == "function_call_output":
        result = _convert(raw, FunctionCallOutputIn, where)
        output = result.output
        text = (
            output
            if isinstance(output, str)
            else "".join(str(part.get("text", "")) for part in output if isinstance(part, dict))
        )
        message = Message("tool", text, tool_call_id=result.call_id)
    else:
        reasoning = _convert(raw, ReasoningIn, where)
        texts = [str(part.get("text", "")) for part in reasoning.summary]
        message = Message("assistant", reasoning="".join(texts))
    feature, why = _ITEMS_NOT_SERVED_YET[kind]
    unserved.add(
        feature, invalid(f"`{where}.type` {kind!r} is not supported: {why}", f"{where}.type")
    )
    return message


def _message_item(item: MessageItemIn, where: str, unserved: Unserved) -> MessageItem:
    output = item.role == "assistant"
    if isinstance(item.content, str):
        texts = [item.content]
    else:
        texts = []
        for j, raw in enumerate(item.content):
            part_where = f"{where}.content[{j}]"
            kind = raw.get("type")
            if kind == "input_image":
                image_part(raw, part_where, unserved)
                continue
            if kind not in ("input_text", "output_text"):
                raise invalid(
                    f"`{part_where}.type` {kind!r} is not supported: only input_text, "
                    "output_text and input_image content parts are served",
                    f"{part_where}.type",
                )
            texts.append(_convert(raw, TextPartIn, part_where).text)
    content: list[InputText | OutputText] = [
        OutputText(text) if output else InputText(text) for text in texts
    ]
    item_id = item.id or new_id("msg")
    return MessageItem(id=item_id, role=item.role, content=content)


def image_part(raw: dict[str, Any], where: str, unserved: Unserved) -> ImagePart:
    """An input_image part as a neutral image (recorded: text models do not serve it)."""
    part = _convert(raw, ImagePartIn, where)
    if part.image_url is None:
        field = "file_id" if part.file_id is not None else "image_url"
        raise unsupported(f"{where}.{field}", "an image needs `image_url` (files are not served)")
    image = image_from_url(part.image_url, f"{where}.image_url", part.detail)
    error = invalid(
        f"`{where}.type` 'input_image' is not supported: image input is not served by text models",
        f"{where}.type",
    )
    unserved.add("image", error)
    return image


def item_text(item: MessageItem) -> str:
    return "".join(part.text for part in item.content)


def messages_of(items: list[MessageItem], instructions: str | None) -> list[Message]:
    """The chat messages the model sees: instructions as a system message first."""
    messages = [Message("system", instructions)] if instructions else []
    for item in items:
        role = "system" if item.role == "developer" else item.role
        messages.append(Message(role, item_text(item)))
    return messages


def sampling_of(body: ResponsesRequest) -> SamplingParams:
    return sampling(body.max_output_tokens, body.temperature, body.top_p)


def canonical_of(
    body: ResponsesRequest, history: list[MessageItem], own: list[MessageItem]
) -> CanonicalRequest:
    return CanonicalRequest(messages=messages_of(history + own, body.instructions))


def new_response(body: ResponsesRequest, status: str = "in_progress") -> ResponseObject:
    """The response object for a request, echoing its settings; no output yet."""
    return ResponseObject(
        id=new_id("resp"),
        created_at=int(time.time()),
        status=status,
        background=body.background,
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        metadata=dict(body.metadata or {}),
        model=body.model,
        parallel_tool_calls=True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        previous_response_id=body.previous_response_id,
        safety_identifier=body.safety_identifier,
        prompt_cache_key=body.prompt_cache_key,
        store=body.store,
        temperature=1.0 if body.temperature is None else body.temperature,
        tool_choice=body.tool_choice or "auto",
        top_p=1.0 if body.top_p is None else body.top_p,
        user=body.user,
    )


def usage_of(usage: Usage | None) -> ResponseUsage:
    usage = usage or Usage()
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(usage.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(0),
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
    )


def item_page(
    items: list[MessageItem], after: str | None, limit: int, order: str
) -> ItemList | None:
    """A page of a response's input items (OpenAI's cursor list); None: `after` is unknown."""
    ordered = list(reversed(items)) if order == "desc" else list(items)
    if after is not None:
        ids = [item.id for item in ordered]
        if after not in ids:
            return None
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return ItemList(
        data=page,
        first_id=page[0].id if page else None,
        last_id=page[-1].id if page else None,
        has_more=len(ordered) > limit,
    )


# ---- responses ---------------------------------------------------------------------------


class ResponsesFormatter:
    """Builds one response: the JSON body, or the stream's events. The ResponseObject it is
    given is updated in place as the generation goes (a background response's stored copy
    is that object); `on_done` sees it once, when it has ended (completed, incomplete or
    failed)."""

    def __init__(
        self,
        response: ResponseObject,
        on_done: Callable[[ResponseObject], None] | None = None,
    ) -> None:
        self.resp = response
        self.on_done = on_done
        self.item = MessageItem(
            id=new_id("msg"), status="in_progress", role="assistant", content=[]
        )
        self.pieces: list[str] = []
        self.sequence = 0
        self.started = False  # created and in progress
        self.opened = False  # its message item exists (the first delta came)
        self.ended = False
        self.finish: FinishReason | None = None
        self.usage: Usage | None = None  # the latest a delta carried (the first has the prompt's)
        self.output_tokens = 0
        self.encode = msgspec.json.Encoder().encode

    # -- state ---------------------------------------------------------------------------

    def start(self) -> None:
        self.started = True
        self.resp.status = "in_progress"

    def _output(self, status: str) -> None:
        """The message so far as the response's output."""
        text = "".join(self.pieces)
        self.item.status = status
        self.item.content = [OutputText(text)]
        self.resp.output = [self.item]

    def _end(self, status: str) -> None:
        self.ended = True
        self.resp.status = status
        if status == "completed":  # OpenAI: only present when completed
            self.resp.completed_at = int(time.time())
        if self.on_done is not None:
            self.on_done(self.resp)

    def complete(self, finish: FinishReason | None, usage: Usage | None) -> None:
        length = finish == FinishReason.LENGTH
        self._output("incomplete" if length else "completed")
        self.resp.usage = usage_of(usage)
        if length:
            self.resp.incomplete_details = IncompleteDetails("max_output_tokens")
        self._end("incomplete" if length else "completed")

    def _partial(self) -> None:
        """An end before the finish: the text and the tokens so far."""
        if not self.opened:
            return
        self._output("incomplete")
        prompt = self.usage.prompt_tokens if self.usage is not None else 0
        cached = self.usage.cached_tokens if self.usage is not None else 0
        self.resp.usage = usage_of(Usage(prompt, self.output_tokens, cached))

    def fail(self, error: GatewayError) -> None:
        self._partial()
        self.resp.error = ResponseError(error.code.value, error.message)
        self._end("failed")

    def cancel(self) -> None:
        """A background response cancelled: what it had generated stays."""
        if self.ended:
            return
        self._partial()
        self._end("cancelled")

    # -- the stream ------------------------------------------------------------------------

    def _event(self, name: str, **fields: Any) -> bytes:
        data = {"type": name, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_event(name, self.encode(data))

    def _opening(self) -> bytes:
        self.start()
        return self._event("response.created", response=self.resp) + self._event(
            "response.in_progress", response=self.resp
        )

    def stream_start(self, first: RequestOutput) -> bytes:
        opening = self._opening()
        self.opened = True
        item = MessageItem(id=self.item.id, status="in_progress", role="assistant", content=[])
        return (
            opening
            + self._event("response.output_item.added", output_index=0, item=item)
            + self._event(
                "response.content_part.added",
                item_id=self.item.id,
                output_index=0,
                content_index=0,
                part=OutputText(""),
            )
        )

    def stream_delta(self, index: int, output: RequestOutput) -> bytes:
        if output.usage is not None:
            self.usage = output.usage
        self.output_tokens += len(output.token_ids)
        if not output.text:
            return b""
        self.pieces.append(output.text)
        return self._event(
            "response.output_text.delta",
            item_id=self.item.id,
            output_index=0,
            content_index=0,
            delta=output.text,
            logprobs=[],
        )

    def stream_finish(self, index: int, output: RequestOutput) -> bytes:
        self.finish = output.finish_reason
        if output.usage is not None:
            self.usage = output.usage
        text = "".join(self.pieces)
        status = "incomplete" if self.finish == FinishReason.LENGTH else "completed"
        self._output(status)
        where = {"item_id": self.item.id, "output_index": 0, "content_index": 0}
        return (
            self._event("response.output_text.done", **where, text=text, logprobs=[])
            + self._event("response.content_part.done", **where, part=OutputText(text))
            + self._event("response.output_item.done", output_index=0, item=self.item)
        )

    def stream_end(self, usage: Usage) -> bytes:
        self.complete(self.finish, usage)
        incomplete = self.resp.status == "incomplete"
        name = "response.incomplete" if incomplete else "response.completed"
        return self._event(name, response=self.resp)

    def stream_error(self, error: GatewayError) -> bytes:
        opening = b"" if self.started else self._opening()
        self.fail(error)
        return (
            opening
            + self._event("error", code=error.code.value, message=error.message, param=error.param)
            + self._event("response.failed", response=self.resp)
        )

    def response(self, choices: list[Choice], usage: Usage) -> bytes:
        choice = choices[0]
        self.started = True
        self.pieces = [choice.text]
        self.complete(choice.finish_reason, usage)
        return self.encode(self.resp)
