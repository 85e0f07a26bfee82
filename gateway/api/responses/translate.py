"""Pure translation of Responses API requests into the canonical types. No I/O here.

A response's conversation is a list of items: the history it was chained onto (the previous
response's conversation and output), then its own input. `instructions` become a system
message first and are never carried to a chained response (as OpenAI documents).

Items become chat messages in order: a message item is a message; function_call items join
the assistant message right before them (or start one); a function_call_output is a `tool`
message answering its call; a reasoning item's text is the reasoning of the next assistant
message, and is dropped when a user, system or tool message comes first.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import msgspec

from gateway.api.common import (
    Unserved,
    image_from_url,
    invalid,
    media_parts,
    sampling,
    unsupported,
)
from gateway.api.responses.options import (
    Options,
    convert,
    options_of,
    reasoning_echo,
    tools_echo,
)
from gateway.api.responses.schemas import (
    ContentPart,
    FunctionCallIn,
    FunctionCallItem,
    FunctionCallOutputIn,
    FunctionCallOutputItem,
    ImagePartIn,
    InputImage,
    InputText,
    InputTokensDetails,
    Item,
    ItemList,
    MessageItem,
    MessageItemIn,
    OutputText,
    OutputTokensDetails,
    ReasoningIn,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextOut,
    TextPartIn,
)
from shared.types import (
    CanonicalRequest,
    ImagePart,
    Message,
    SamplingParams,
    TextPart,
    ToolCall,
    Usage,
)
from shared.types import ContentPart as Part

ROLES = ("user", "assistant", "system", "developer")
# Statuses of a response whose generation has not ended (background mode).
RUNNING = ("queued", "in_progress")
# What each item type other than a message uses of the neutral message, for Unserved.
_ITEM_FEATURES = {
    "function_call": "tool_calls",
    "function_call_output": "tool_result",
    "reasoning": "reasoning",
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- requests ----------------------------------------------------------------------------


# what `include` may ask for: the reasoning text sealed in each reasoning item, so that a
# client that stores nothing here (`store` false: Codex and other agents) can pass it back
INCLUDABLE = {"reasoning.encrypted_content"}
SEAL = "mlxgw1:"  # a sealed reasoning text: this prefix, then its UTF-8 in base64url


def seal(text: str) -> str:
    """The reasoning text as `encrypted_content`: opaque to clients, read back here. Not
    encrypted (it is the item's own `content`, which the client has): only made to go
    back and forth as OpenAI's does."""
    return SEAL + base64.urlsafe_b64encode(text.encode()).decode()


def unseal(blob: str, where: str) -> str | None:
    """A sealed reasoning text passed back; None: not one of ours (OpenAI's own, which
    only OpenAI reads); one of ours that does not decode is a 400 naming it."""
    if not blob.startswith(SEAL):
        return None
    try:
        return base64.b64decode(blob[len(SEAL) :], altchars=b"-_", validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        raise invalid(
            "`encrypted_content` is not one this gateway made (it does not decode)",
            f"{where}.encrypted_content",
        ) from None


def check_request(body: ResponsesRequest, omit_hosted: bool = False) -> Options:
    """Every documented field this gateway cannot honour is a 400 naming it; the options
    it does honour (tools, formats, reasoning) are checked and returned (`omit_hosted`:
    tools of kinds no model here runs are left out, not refused)."""
    for value in body.include or []:
        if value not in INCLUDABLE:
            raise unsupported(
                "include", f"{value!r} is not served (only {', '.join(sorted(INCLUDABLE))})"
            )
    if body.top_logprobs:
        raise unsupported("top_logprobs", "logprobs are not served on the Responses API yet")
    if body.truncation == "auto":
        raise unsupported("truncation", "'auto' is not served; only 'disabled'")
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
    return options_of(body, omit_hosted)


def input_items(
    body_input: str | list[dict[str, Any]], unserved: Unserved | None = None
) -> list[Item]:
    """The request's own input as conversation items (a string is one user message), one
    per input entry. What the neutral model carries but a worker may not serve (images,
    function calls and their outputs, reasoning) is recorded in `unserved` (None: refused
    here unless served)."""
    uses = unserved if unserved is not None else Unserved()
    if isinstance(body_input, str):
        return [MessageItem(id=new_id("msg"), role="user", content=[InputText(body_input)])]
    items: list[Item] = []
    for i, raw in enumerate(body_input):
        where = f"input[{i}]"
        kind = raw.get("type", "message")
        if kind in _ITEM_FEATURES:
            items.append(item_of(raw, where, uses))
            continue
        if kind != "message":
            raise invalid(
                f"`{where}.type` {kind!r} is not supported: only message, function_call, "
                "function_call_output and reasoning items are served",
                f"{where}.type",
            )
        item = convert(raw, MessageItemIn, where)
        if item.role not in ROLES:
            raise invalid(
                f"`{where}.role` {item.role!r} is not supported (one of {', '.join(ROLES)})",
                f"{where}.role",
            )
        items.append(_message_item(item, where, uses))
    if unserved is None:
        uses.refuse()
    return items


def item_of(raw: dict[str, Any], where: str, unserved: Unserved) -> Item:
    """A function_call, function_call_output or reasoning input item, as stored."""
    kind = raw["type"]
    unserved.add(
        _ITEM_FEATURES[kind],
        invalid(f"`{where}.type` {kind!r} is not served by this model", f"{where}.type"),
    )
    if kind == "function_call":
        call = convert(raw, FunctionCallIn, where)
        return FunctionCallItem(
            id=call.id or new_id("fc"),
            call_id=call.call_id,
            name=call.name,
            arguments=call.arguments,
        )
    if kind == "function_call_output":
        result = convert(raw, FunctionCallOutputIn, where)
        output: str | list[InputText | InputImage]
        if isinstance(result.output, str):
            output = result.output
        else:
            parts = [
                _output_part(part, f"{where}.output[{j}]", unserved)
                for j, part in enumerate(result.output)
            ]
            texts = [part.text for part in parts if isinstance(part, InputText)]
            output = parts if len(texts) < len(parts) else "".join(texts)  # images: the parts
        return FunctionCallOutputItem(
            id=result.id or new_id("fco"), call_id=result.call_id, output=output
        )
    reasoning = convert(raw, ReasoningIn, where)
    content = reasoning.content or []
    sealed = reasoning.encrypted_content
    if not content and sealed and (text := unseal(sealed, where)) is not None:
        content = [ReasoningText(text)]
    return ReasoningItem(
        id=reasoning.id or new_id("rs"), summary=reasoning.summary, content=content
    )


def _output_part(part: dict[str, Any], where: str, unserved: Unserved) -> InputText | InputImage:
    """A part of a function's output: text, or an image (for a vision model)."""
    kind = part.get("type")
    if kind == "input_image":
        image = image_part(part, where, unserved)
        return InputImage(part["image_url"], image.detail or "auto")
    if kind != "input_text":
        raise invalid(
            f"`{where}.type` {kind!r} is not supported: a function's output is text or images "
            "(a string, or input_text and input_image parts)",
            f"{where}.type",
        )
    return InputText(convert(part, TextPartIn, where).text)


def item_message(raw: dict[str, Any], where: str, unserved: Unserved) -> Message:
    """A function_call, function_call_output or reasoning item as a neutral message alone."""
    return message_of(item_of(raw, where, unserved))


def _message_item(item: MessageItemIn, where: str, unserved: Unserved) -> MessageItem:
    """A message item as stored: each content part in order (one per part given)."""
    text = OutputText if item.role == "assistant" else InputText
    content: list[ContentPart] = []
    if isinstance(item.content, str):
        content.append(text(item.content))
    else:
        for j, raw in enumerate(item.content):
            part_where = f"{where}.content[{j}]"
            kind = raw.get("type")
            if kind == "input_image":
                image = image_part(raw, part_where, unserved)
                content.append(InputImage(raw["image_url"], image.detail or "auto"))
                continue
            if kind not in ("input_text", "output_text"):
                raise invalid(
                    f"`{part_where}.type` {kind!r} is not supported: only input_text, "
                    "output_text and input_image content parts are served",
                    f"{part_where}.type",
                )
            content.append(text(convert(raw, TextPartIn, part_where).text))
    item_id = item.id or new_id("msg")
    return MessageItem(id=item_id, role=item.role, content=content)


def image_part(raw: dict[str, Any], where: str, unserved: Unserved) -> ImagePart:
    """An input_image part as a neutral image, named by `where`.image_url (recorded: a
    model that takes no images refuses it)."""
    part = convert(raw, ImagePartIn, where)
    if part.image_url is None:
        field = "file_id" if part.file_id is not None else "image_url"
        raise unsupported(f"{where}.{field}", "an image needs `image_url` (files are not served)")
    detail = "high" if part.detail == "original" else part.detail  # Codex's full resolution
    image = image_from_url(part.image_url, f"{where}.image_url", detail)
    error = invalid(
        f"`{where}.type` 'input_image' is not supported: image input is not served",
        f"{where}.type",
    )
    unserved.add("image", error)
    return image


def item_text(item: MessageItem) -> str:
    return "".join(part.text for part in item.content if not isinstance(part, InputImage))


def _parts(content: list[Any], where: str | None) -> list[Part]:
    """A message item's content (or a function output's parts) as neutral parts: its
    images named by their field in this request's `input` (`where` the list's), or by
    `previous_response_id` for an item of the conversation it was chained onto (an image
    fetched again is checked again)."""
    parts: list[Part] = []
    for j, part in enumerate(content):
        if isinstance(part, InputImage):
            field = f"{where}[{j}].image_url" if where else "previous_response_id"
            parts.append(image_from_url(part.image_url, field, part.detail))
        else:
            parts.append(TextPart(part.text))
    return parts


def reasoning_text(item: ReasoningItem) -> str:
    """Its reasoning text; an item with none (OpenAI's own) has its summaries."""
    parts = item.content or item.summary
    return "".join(part.text for part in parts)


def message_of(item: Item, where: str | None = None) -> Message:
    """One item as a neutral message on its own; `where`: the item's place in the
    request's `input` (None: an item of an earlier response)."""
    if isinstance(item, MessageItem):
        role = "system" if item.role == "developer" else item.role
        content = f"{where}.content" if where else None
        return Message(role, item_text(item), parts=media_parts(_parts(item.content, content)))
    if isinstance(item, FunctionCallItem):
        return Message("assistant", tool_calls=[ToolCall(item.call_id, item.name, item.arguments)])
    if isinstance(item, FunctionCallOutputItem):
        if isinstance(item.output, str):
            return Message("tool", item.output, tool_call_id=item.call_id)
        parts = _parts(item.output, f"{where}.output" if where else None)
        text = "".join(part.text for part in item.output if isinstance(part, InputText))
        return Message("tool", text, parts=media_parts(parts), tool_call_id=item.call_id)
    return Message("assistant", reasoning=reasoning_text(item))


def messages_of(items: list[Item], instructions: str | None, history: int = 0) -> list[Message]:
    """The chat messages the model sees: instructions as a system message first, then the
    items (see the module's docstring), the first `history` of them from earlier responses
    and the rest the request's `input`, one item per entry."""
    messages = [Message("system", instructions)] if instructions else []
    thinking: list[str] = []  # reasoning items waiting for their assistant message
    joinable = False  # the item before was an assistant message or call: calls join it
    for k, item in enumerate(items):
        message = message_of(item, f"input[{k - history}]" if k >= history else None)
        if isinstance(item, ReasoningItem):
            thinking.append(message.reasoning or "")
            joinable = False
            continue
        if isinstance(item, FunctionCallItem) and joinable:
            last = messages[-1]
            calls = last.tool_calls + message.tool_calls
            messages[-1] = msgspec.structs.replace(last, tool_calls=calls)
            continue
        if message.role == "assistant" and thinking:
            message = msgspec.structs.replace(message, reasoning="\n".join(thinking))
        thinking = []
        messages.append(message)
        joinable = message.role == "assistant"
    return messages


def check_results(history: list[Item], own: list[Item]) -> None:
    """Each function_call_output of the input answers a call made before it."""
    calls = {item.call_id for item in history if isinstance(item, FunctionCallItem)}
    for i, item in enumerate(own):
        if isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in calls:
            raise invalid(
                f"`input[{i}].call_id` {item.call_id!r} answers no function call made before it",
                f"input[{i}].call_id",
            )


def sampling_of(body: ResponsesRequest) -> SamplingParams:
    return sampling(body.max_output_tokens, body.temperature, body.top_p)


def canonical_of(
    body: ResponsesRequest,
    history: list[Item],
    own: list[Item],
    options: Options | None = None,
) -> CanonicalRequest:
    options = options or options_of(body)
    check_results(history, own)
    return CanonicalRequest(
        messages=messages_of(history + own, body.instructions, len(history)),
        tools=options.tools,
        tool_choice=options.tool_choice,
        response_format=options.response_format,
        reasoning=options.reasoning,
    )


def new_response(
    body: ResponsesRequest, status: str = "in_progress", options: Options | None = None
) -> ResponseObject:
    """The response object for a request, echoing its settings; no output yet."""
    options = options or options_of(body)
    text = body.text.format if body.text is not None else None
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
        reasoning=reasoning_echo(body.reasoning),
        safety_identifier=body.safety_identifier,
        prompt_cache_key=body.prompt_cache_key,
        store=body.store,
        temperature=1.0 if body.temperature is None else body.temperature,
        text=TextOut() if text is None else TextOut(text),
        tool_choice="auto" if body.tool_choice is None else body.tool_choice,
        tools=tools_echo(options.tools),
        top_p=1.0 if body.top_p is None else body.top_p,
        user=body.user,
    )


def usage_of(usage: Usage | None) -> ResponseUsage:
    usage = usage or Usage()
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(usage.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(usage.reasoning_tokens),
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
    )


def item_page(items: list[Item], after: str | None, limit: int, order: str) -> ItemList | None:
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
