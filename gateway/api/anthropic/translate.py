"""Pure translation of Anthropic Messages requests into the canonical types (the responses
are formatter.py's). No I/O here."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import msgspec

from gateway.api.anthropic.formatter import MessagesFormatter
from gateway.api.anthropic.schemas import (
    ClearThinking,
    ContextManagement,
    ImageBlock,
    MessageParam,
    MessagesRequest,
    OutputConfig,
    PromptFields,
    TextBlock,
    ThinkingAdaptive,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    ThinkingParam,
    ToolResultBlock,
    ToolUseBlock,
)
from gateway.api.anthropic.tools import tool_choice_of, tools_of
from gateway.api.common import (
    Unserved,
    image_bytes,
    image_from_url,
    invalid,
    media_parts,
    sampling,
    text_of,
)
from gateway.errors import validation_error
from shared.types import (
    CanonicalRequest,
    ImagePart,
    Message,
    OutputFormat,
    Reasoning,
    ResponseFormat,
    SamplingParams,
    TextPart,
    ToolCall,
)
from shared.types import ContentPart as Part

T = TypeVar("T")

MESSAGES_PATH = "/v1/messages"  # error bodies in Anthropic's shape
BILLING = "x-anthropic-billing-header:"  # Claude Code's first system block
# A tool_result with is_error: what the model reads before its content
ERROR_PREFIX = "Error: "

# Content block types Anthropic documents that have no place in the neutral message, and why.
_BLOCKS_NOT_SERVED = {
    "document": "document input is not served",
    "search_result": "search results are not served",
    "server_tool_use": "server tools are not served",
    "web_search_tool_result": "server tools are not served",
    "redacted_thinking": "it is encrypted by Anthropic; send `thinking` blocks",
    "container_upload": "containers are not served",
}
# Blocks the neutral message carries: the feature each uses (refused while the gateway does
# not serve it, see common.SERVED), and why.
_FEATURES = {
    "image": ("image", "image input is not served"),
    "tool_use": ("tool_calls", "tool use in the history is not served"),
    "tool_result": ("tool_result", "tool results are not served"),
    "thinking": ("reasoning", "thinking in the history is not served"),
}


def _convert(block: dict[str, Any], type_: type[T], where: str) -> T:
    try:
        return msgspec.convert(block, type_)
    except msgspec.ValidationError as exc:
        raise validation_error(exc, where) from exc


def _image(block: dict[str, Any], where: str) -> ImagePart:
    """An image block's source, base64 or URL: the image is named by `where`.source."""
    source = _convert(block, ImageBlock, where).source
    others = ("media_type", "data") if source.type == "url" else ("url",)
    for field in others:  # the other kind's fields: which would it be?
        if getattr(source, field) is not None:
            raise invalid(
                f"`{where}.source` of type {source.type!r} has no `{field}`",
                f"{where}.source.{field}",
            )
    if source.type == "url":
        if not source.url:
            raise invalid(f"`{where}.source` of type 'url' needs `url`", f"{where}.source.url")
        image = image_from_url(source.url, f"{where}.source.url")
    elif source.data is None or source.media_type is None:
        raise invalid(
            f"`{where}.source` of type 'base64' needs `media_type` and `data`", f"{where}.source"
        )
    else:
        image = ImagePart(image_bytes(source.data, f"{where}.source.data"), source.media_type)
    return msgspec.structs.replace(image, where=f"{where}.source")


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
        if kind not in _FEATURES:
            why = _BLOCKS_NOT_SERVED.get(kind, "only text content blocks are served")
            raise invalid(f"`{where}` is a content block of type {kind!r}: {why}", where)
        if kind == "image":
            self.parts.append(_image(block, where))
        elif kind == "tool_use":
            use = _convert(block, ToolUseBlock, where)
            if use.caller is not None and use.caller.get("type") != "direct":
                raise invalid(
                    f"`{where}.caller`: calls made by server tools are not served",
                    f"{where}.caller",
                )
            self.calls.append(ToolCall(use.id, use.name, json.dumps(use.input)))
        elif kind == "tool_result":
            result = _convert(block, ToolResultBlock, where)
            inner = _Turn("tool", self.unserved)
            if result.is_error:  # chat templates have no such flag: the model reads it
                inner.parts.append(TextPart(ERROR_PREFIX))
            if isinstance(result.content, str):
                inner.parts.append(TextPart(result.content))
            else:
                for j, sub in enumerate(result.content):
                    inner.block(f"{where}.content[{j}]", sub)
            self.results.append(inner.message(tool_call_id=result.tool_use_id))
        else:
            self.reasoning.append(_convert(block, ThinkingBlock, where).thinking)
        feature, why = _FEATURES[kind]
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
        texts = self.parts and all(isinstance(part, TextPart) for part in self.parts)
        if self.results and texts and self.role == "user":
            # text after a turn's tool results (Claude Code's reminders) goes with the last
            # result: as a user message of its own it would read as a new question, and
            # templates then drop the thinking of the tool loop it goes on with (and with it
            # the prefix that the next turn would reuse)
            return [*self.results[:-1], _with_text(self.results[-1], text_of(self.parts))]
        rest = self.parts or self.calls or self.reasoning or not self.results
        return self.results + ([self.message()] if rest else [])


def _with_text(result: Message, text: str) -> Message:
    """A tool message with `text` after its content, a blank line apart."""
    added = f"\n\n{text}" if result.content else text
    parts = [*result.parts, TextPart(added)] if result.parts else []
    return msgspec.structs.replace(result, content=(result.content or "") + added, parts=parts)


def _messages(index: int, message: MessageParam, unserved: Unserved) -> list[Message]:
    if isinstance(message.content, str):
        return [Message(role=message.role, content=message.content)]
    turn = _Turn(message.role, unserved)
    where = f"messages[{index}].content"
    for j, block in enumerate(message.content):
        turn.block(f"{where}[{j}]", block)
    return turn.messages()


def _system(system: str | list[TextBlock] | None, more: list[str]) -> str:
    """The system prompt: `system`'s blocks, then the conversation's system messages
    (`more`), a blank line apart. Claude Code's billing block (a line for Anthropic's
    servers whose checksum changes with every request) is left out: it would end the
    prefix that every turn shares at its first line."""
    if system is None:
        blocks = ""
    elif isinstance(system, str):
        blocks = system
    else:
        blocks = _joined([block.text for block in system if not block.text.startswith(BILLING)])
    return "\n\n".join(text for text in [blocks, *more] if text)


def _joined(texts: list[str]) -> str:
    """Text blocks as one text: as written where a block ends or starts with a space, else a
    line apart (blocks that are paragraphs of their own must not run together)."""
    joined = ""
    for text in texts:
        apart = joined and text and not joined[-1].isspace() and not text[0].isspace()
        joined += ("\n" if apart else "") + text
    return joined


def _system_message(index: int, message: MessageParam) -> str:
    """A system message of the conversation: its text (text blocks only)."""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, block in enumerate(message.content):
        where = f"messages[{index}].content[{j}]"
        if block.get("type") != "text":
            raise invalid(f"`{where}`: a system message holds text blocks only", f"{where}.type")
        texts.append(_convert(block, TextBlock, where).text)
    return "\n\n".join(texts)


def _kept_thinking(edits: ContextManagement | None) -> int | None:
    """How many of the latest assistant turns keep their thinking (None: all)."""
    keep: int | None = None
    for i, raw in enumerate(edits.edits if edits is not None else []):
        where = f"context_management.edits[{i}]"
        if raw.get("type") != "clear_thinking_20251015":
            raise invalid(
                f"`{where}.type` {raw.get('type')!r} is not served: only clear_thinking_20251015 "
                "(nothing else is cleared from the context here)",
                f"{where}.type",
            )
        edit = _convert(raw, ClearThinking, where)
        keep = None if edit.keep == "all" else edit.keep.value
    return keep


def _clear_thinking(messages: list[Message], keep: int | None) -> list[Message]:
    """The thinking of all but the last `keep` assistant turns that thought, left out."""
    if keep is None:
        return messages
    # a turn: from a user's message to the next (a tool loop's steps, the results between
    # them, are one turn)
    turns, turn = [], 0
    for message in messages:
        turn += message.role == "user"
        turns.append(turn)
    thought = sorted({turns[i] for i, m in enumerate(messages) if m.reasoning})
    kept = set(thought[max(0, len(thought) - keep) :])
    return [
        msgspec.structs.replace(m, reasoning=None) if m.reasoning and turns[i] not in kept else m
        for i, m in enumerate(messages)
    ]


def _output_config(
    config: OutputConfig | None, reasoning: Reasoning | None
) -> tuple[Reasoning | None, ResponseFormat | None]:
    """`effort` into the thinking's settings, `format` as the answer's JSON schema."""
    if config is None:
        return reasoning, None
    if config.effort is not None:  # guidance: a template that takes none goes without
        effort = "high" if config.effort in ("xhigh", "max") else config.effort
        given = reasoning or Reasoning()
        reasoning = msgspec.structs.replace(given, effort=effort, advisory=True)
    fmt = config.format
    if fmt is None:
        return reasoning, None
    param = "output_config.format"
    if fmt.get("type") != "json_schema" or set(fmt) - {"type", "schema"}:
        raise invalid(f'`{param}` must be {{"type": "json_schema", "schema": {{...}}}}', param)
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise invalid(f"`{param}.schema` must be a JSON schema object", f"{param}.schema")
    return reasoning, ResponseFormat(OutputFormat.JSON_SCHEMA, schema, None, True, param)


def _reasoning(thinking: ThinkingParam | None) -> Reasoning | None:
    """`enabled` (with its budget) turns thinking on, `disabled` off; `adaptive` leaves it
    to the model as deployed (its template's default, or its configured one; none where it
    cannot think: Claude Code sends it with every request), as does leaving it out."""
    if thinking is None:
        return None
    if isinstance(thinking, ThinkingDisabled):
        return Reasoning(enabled=False)
    if isinstance(thinking, ThinkingEnabled):
        return Reasoning(enabled=True, budget_tokens=thinking.budget_tokens)
    return Reasoning(advisory=True)


def prompt_request(req: PromptFields, omit_hosted: bool = False) -> CanonicalRequest:
    """The chat request the messages, system prompt, tools and thinking make. A last
    assistant message is a prefill: the model continues it (an empty one is no prefill: a
    new assistant turn). `omit_hosted`: server tools are left out, not refused."""
    unserved = Unserved()
    messages: list[Message] = []
    instructions: list[str] = []  # the conversation's system messages
    for i, message in enumerate(req.messages):
        if message.role == "system":
            instructions.append(_system_message(i, message))
        else:
            messages += _messages(i, message, unserved)
    if not messages:
        raise invalid("`messages` must hold a user or assistant message", "messages")
    unserved.refuse()
    last = messages[-1]
    if len(messages) > 1 and last.role == "assistant" and not last.content and not last.extras():
        messages.pop()
    messages = _clear_thinking(messages, _kept_thinking(req.context_management))
    system = _system(req.system, instructions)
    if system:
        messages.insert(0, Message(role="system", content=system))
    # (a system message after it says the assistant's turn is a new one)
    prefill = messages[-1].role == "assistant" and req.messages[-1].role == "assistant"
    tools = tools_of(req.tools, omit_hosted)
    reasoning, fmt = _output_config(req.output_config, _reasoning(req.thinking))
    return CanonicalRequest(
        messages=messages,
        add_generation_prompt=not prefill,
        chat_template_kwargs={"continue_final_message": True} if prefill else {},
        tools=tools,
        tool_choice=tool_choice_of(req.tool_choice, tools),
        response_format=fmt,
        reasoning=reasoning,
    )


def _stop_sequences(stops: list[str] | None) -> list[str]:
    if stops and any(not text for text in stops):
        raise invalid("stop_sequences must not contain an empty string", "stop_sequences")
    return list(stops or [])


def _check_budget(req: MessagesRequest) -> None:
    """Thinking counts toward max_tokens: its budget must leave room for the answer."""
    thinking = req.thinking
    if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens >= req.max_tokens:
        raise invalid(
            f"`thinking.budget_tokens` ({thinking.budget_tokens}) must be less than "
            f"`max_tokens` ({req.max_tokens}): thinking counts toward max_tokens",
            "thinking.budget_tokens",
        )


def messages_request(
    req: MessagesRequest, omit_hosted: bool = False
) -> tuple[CanonicalRequest, SamplingParams]:
    _check_budget(req)
    canonical = prompt_request(req, omit_hosted)
    params = sampling(
        req.max_tokens,
        req.temperature,
        req.top_p,
        req.top_k,
        stop=_stop_sequences(req.stop_sequences),
    )
    return canonical, params


def messages_formatter(
    req: MessagesRequest, canonical: CanonicalRequest, model_thinks: bool = False
) -> MessagesFormatter:
    """The request's formatter. A stream opens its text block at once (as for plain text
    always) unless the answer may begin with thinking or a tool call: the request asks
    for them, or the model thinks unless told not to (`model_thinks`)."""
    needs = canonical.needs()
    thinks = "reasoning" in needs or (
        model_thinks and not isinstance(req.thinking, ThinkingDisabled)
    )
    text_first = "tools" not in needs and not thinks
    thinking = req.thinking
    omitted = isinstance(thinking, ThinkingEnabled | ThinkingAdaptive) and (
        thinking.display == "omitted"
    )
    return MessagesFormatter(req.model, text_first, show_thinking=not omitted)
