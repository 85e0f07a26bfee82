"""OpenAI chat messages onto the neutral message model: text and content parts (images as
data or http(s) URLs, audio), an assistant's tool calls, reasoning and refusal, tool
results. Each use beyond text is recorded in `Unserved`, with the 400 naming its field for
when it is not served (today: audio). An image carries its field's path (`where`)."""

from __future__ import annotations

from gateway.api.common import (
    Unserved,
    image_bytes,
    image_from_url,
    invalid,
    media_parts,
    text_of,
    unsupported,
)
from gateway.api.openai.schemas import ChatMessage, ContentPart
from shared.types import AudioPart, Message, TextPart, ToolCall
from shared.types import ContentPart as Part


def message_of(index: int, message: ChatMessage, unserved: Unserved | None = None) -> Message:
    """One chat message as the neutral model has it; what it uses beyond text is recorded
    in `unserved` (None: refused at once)."""
    where = f"messages[{index}]"
    uses = unserved if unserved is not None else Unserved()
    content = message.content
    parts: list[Part] = []
    if isinstance(content, list):
        for j, part in enumerate(content):
            parts.append(_part(part, f"{where}.content[{j}]", uses))
        text = text_of(parts)
    else:
        text = content or ""
    role = "system" if message.role == "developer" else message.role
    if message.role == "tool" and not message.tool_call_id:
        raise invalid("a tool message needs the `tool_call_id` it answers", f"{where}.tool_call_id")
    if message.role != "tool" and message.tool_call_id is not None:
        raise invalid("only a tool message has a `tool_call_id`", f"{where}.tool_call_id")
    if message.role != "assistant":
        for field in ("tool_calls", "reasoning_content", "refusal", "audio", "function_call"):
            if getattr(message, field) is not None:
                raise invalid(f"only an assistant message has `{field}`", f"{where}.{field}")
    if message.audio is not None:
        raise unsupported(f"{where}.audio", "an assistant's audio in the history is not served")
    if message.function_call is not None:
        raise unsupported(f"{where}.function_call", "use `tool_calls` (legacy function calling)")
    if message.annotations:
        raise unsupported(f"{where}.annotations", "annotations in the history are not served")
    calls = [
        ToolCall(call.id, call.function.name, call.function.arguments)
        for call in message.tool_calls or []
    ]
    if calls:
        uses.add("tool_calls", unsupported(f"{where}.tool_calls", "tool calls in the history"))
    if message.role == "tool":
        uses.add("tool_result", unsupported(f"{where}.role", "tool results in the history"))
    if message.reasoning_content is not None:
        uses.add(
            "reasoning",
            unsupported(f"{where}.reasoning_content", "reasoning in the history"),
        )
    if message.refusal is not None:
        uses.add(
            "refusal", unsupported(f"{where}.refusal", "refusals in the history are not served")
        )
    if unserved is None:
        uses.refuse()
    return Message(
        role=role,
        content=text,
        name=message.name,
        parts=media_parts(parts),
        tool_calls=calls,
        tool_call_id=message.tool_call_id,
        reasoning=message.reasoning_content,
    )


def _part(part: ContentPart, where: str, uses: Unserved) -> Part:
    if part.type == "text" and part.text is not None:
        return TextPart(part.text)
    if part.type == "image_url" and part.image_url is not None:
        image = image_from_url(part.image_url.url, f"{where}.image_url.url", part.image_url.detail)
        uses.add("image", unsupported(where, "image input is not served"))
        return image
    if part.type == "input_audio" and part.input_audio is not None:
        audio = AudioPart(
            image_bytes(part.input_audio.data, f"{where}.input_audio.data"),
            format=part.input_audio.format,
        )
        uses.add("audio", unsupported(where, "audio input is not served by text models"))
        return audio
    if part.type in ("text", "image_url", "input_audio"):
        field = {"text": "text", "image_url": "image_url", "input_audio": "input_audio"}[part.type]
        raise invalid(f"`{where}` of type {part.type!r} needs `{field}`", f"{where}.{field}")
    raise unsupported(where, f"content part of type {part.type!r}")
