"""A response's output as the Responses API writes it: the JSON body, or the stream's events.

The output is a list of items, in the order the model produced them: its reasoning (a
`reasoning` item, the text in `content` as `reasoning_text`, `summary` empty), its answer (a
`message` item: present when it has text or when no call was made) and its calls (one
`function_call` item each, `call_id` the worker's id). A stream opens an item when its first
delta comes and closes it when the next kind of delta (or the end) comes:

    response.output_item.added, response.content_part.added, response.*_text.delta...,
    response.*_text.done, response.content_part.done, response.output_item.done

for reasoning (`reasoning_text`) and messages (`output_text`), and

    response.output_item.added (arguments "", in_progress),
    response.function_call_arguments.delta..., response.function_call_arguments.done,
    response.output_item.done

for each call. Each event has an increasing `sequence_number`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.api.relay import Choice, sse_event
from gateway.api.responses.schemas import (
    FunctionCallItem,
    IncompleteDetails,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
)
from gateway.api.responses.translate import new_id, seal, usage_of
from gateway.errors import GatewayError
from shared.types import FinishReason, RequestOutput, ToolCall, Usage


@dataclass(slots=True)
class _Open:
    """The item receiving deltas: its text (or arguments) so far."""

    item: OutputItem
    index: int  # its output_index
    call: int = -1  # a function call's index among the turn's calls
    pieces: list[str] = field(default_factory=list)


def _finished(item: OutputItem, text: str, status: str, sealed: bool = False) -> None:
    """The item with its whole text, ended with `status`; `sealed`: a reasoning item's
    text in its `encrypted_content` too (include reasoning.encrypted_content)."""
    item.status = status
    if isinstance(item, MessageItem):
        item.content = [OutputText(text)]
    elif isinstance(item, ReasoningItem):
        item.content = [ReasoningText(text)]
        if sealed:
            item.encrypted_content = seal(text)
    else:
        item.arguments = text


def _message(status: str = "completed") -> MessageItem:
    return MessageItem(id=new_id("msg"), status=status, role="assistant", content=[])


def _reasoning(status: str = "completed") -> ReasoningItem:
    return ReasoningItem(id=new_id("rs"), status=status)


def _call(call: ToolCall, status: str = "completed") -> FunctionCallItem:
    return FunctionCallItem(
        id=new_id("fc"), status=status, call_id=call.id, name=call.name, arguments=""
    )


def output_of(choice: Choice, sealed: bool = False) -> list[OutputItem]:
    """A whole choice's output items: reasoning, message, calls; out of tokens, the item
    cut short is incomplete (and the empty answer after reasoning cut short)."""
    items: list[OutputItem] = []
    if choice.reasoning:
        items.append(_reasoning())
        _finished(items[-1], choice.reasoning, "completed", sealed)
    if choice.text or not choice.tool_calls:
        items.append(_message())
        _finished(items[-1], choice.text, "completed")
    for call in choice.tool_calls:
        items.append(_call(call))
        _finished(items[-1], call.arguments, "completed")
    if choice.finish_reason == FinishReason.LENGTH:
        items[-1].status = "incomplete"
        if not choice.text and not choice.tool_calls:  # cut short in its thinking
            items[0].status = "incomplete"
    return items


class ResponsesFormatter:
    """Builds one response: the JSON body, or the stream's events. The ResponseObject it is
    given is updated in place as the generation goes (a background response's stored copy
    is that object); `on_done` sees it once, when it has ended (completed, incomplete or
    failed)."""

    def __init__(
        self,
        response: ResponseObject,
        on_done: Callable[[ResponseObject], None] | None = None,
        sealed: bool = False,
    ) -> None:
        self.resp = response
        self.on_done = on_done
        self.sealed = sealed  # reasoning items carry encrypted_content (`include` asks)
        self.items: list[OutputItem] = []  # the output so far, the open item last
        self.open: _Open | None = None
        self.sequence = 0
        self.started = False  # created and in progress
        self.ended = False
        self.finish: FinishReason | None = None
        self.usage: Usage | None = None  # the latest a delta carried (the first has the prompt's)
        self.output_tokens = 0
        self.encode = msgspec.json.Encoder().encode

    # -- state ---------------------------------------------------------------------------

    def start(self) -> None:
        self.started = True
        self.resp.status = "in_progress"

    def _end(self, status: str) -> None:
        self.ended = True
        self.resp.status = status
        if status == "completed":  # OpenAI: only present when completed
            self.resp.completed_at = int(time.time())
        if self.on_done is not None:
            self.on_done(self.resp)

    def complete(self, finish: FinishReason | None, usage: Usage | None) -> None:
        """The output (self.items) is whole: the response ends with it."""
        length = finish == FinishReason.LENGTH
        self.resp.output = self.items
        self.resp.usage = usage_of(usage)
        if length:
            self.resp.incomplete_details = IncompleteDetails("max_output_tokens")
        self._end("incomplete" if length else "completed")

    def _partial(self) -> None:
        """An end before the finish: the items and the tokens so far (the open one
        incomplete)."""
        if self.open is not None:
            _finished(self.open.item, "".join(self.open.pieces), "incomplete", self.sealed)
            self.open = None
        if self.items:
            self.resp.output = self.items
        if self.usage is None and not self.output_tokens:
            return
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

    # -- the stream's items --------------------------------------------------------------

    def _event(self, name: str, **fields: Any) -> bytes:
        data = {"type": name, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_event(name, self.encode(data))

    def _add(self, item: OutputItem, call: int = -1) -> bytes:
        """Open `item` (the previous open one is closed first)."""
        events = self._close("completed")
        self.open = _Open(item, len(self.items), call)
        self.items.append(item)
        index = self.open.index
        events += self._event("response.output_item.added", output_index=index, item=item)
        if isinstance(item, FunctionCallItem):
            return events
        part = OutputText("") if isinstance(item, MessageItem) else ReasoningText("")
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        return events + self._event("response.content_part.added", **where, part=part)

    def _append(self, delta: str) -> bytes:
        assert self.open is not None
        self.open.pieces.append(delta)
        item, index = self.open.item, self.open.index
        if isinstance(item, FunctionCallItem):
            return self._event(
                "response.function_call_arguments.delta",
                item_id=item.id,
                output_index=index,
                delta=delta,
            )
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        if isinstance(item, MessageItem):
            return self._event("response.output_text.delta", **where, delta=delta, logprobs=[])
        return self._event("response.reasoning_text.delta", **where, delta=delta)

    def _close(self, status: str) -> bytes:
        """The open item's done events (none open: nothing)."""
        if self.open is None:
            return b""
        item, index = self.open.item, self.open.index
        text = "".join(self.open.pieces)
        self.open = None
        _finished(item, text, status, self.sealed)
        where: dict[str, Any] = {"item_id": item.id, "output_index": index}
        if isinstance(item, FunctionCallItem):
            events = self._event("response.function_call_arguments.done", **where, arguments=text)
        else:
            where["content_index"] = 0
            if isinstance(item, MessageItem):
                events = self._event("response.output_text.done", **where, text=text, logprobs=[])
                part: OutputText | ReasoningText = OutputText(text)
            else:
                events = self._event("response.reasoning_text.done", **where, text=text)
                part = ReasoningText(text)
            events += self._event("response.content_part.done", **where, part=part)
        return events + self._event("response.output_item.done", output_index=index, item=item)

    def _into(self, kind: type[MessageItem] | type[ReasoningItem]) -> bytes:
        """The open item is a message (or reasoning): opened if it is not."""
        if self.open is not None and isinstance(self.open.item, kind):
            return b""
        item = _message("in_progress") if kind is MessageItem else _reasoning("in_progress")
        return self._add(item)

    # -- the stream ------------------------------------------------------------------------

    def _opening(self) -> bytes:
        self.start()
        return self._event("response.created", response=self.resp) + self._event(
            "response.in_progress", response=self.resp
        )

    def stream_start(self, first: RequestOutput) -> bytes:
        return self._opening()

    def stream_delta(self, index: int, output: RequestOutput) -> bytes:
        if output.usage is not None:
            self.usage = output.usage
        self.output_tokens += len(output.token_ids)
        events = b""
        if output.reasoning:
            events += self._into(ReasoningItem) + self._append(output.reasoning)
        # the rest of the call open now comes before text after it (a merged delta holds
        # both), new calls after the text
        calls = output.tool_calls
        started = 0
        while (
            started < len(calls)
            and self.open is not None
            and self.open.call == calls[started].index
        ):
            if calls[started].arguments:
                events += self._append(calls[started].arguments)
            started += 1
        if output.text:
            events += self._into(MessageItem) + self._append(output.text)
        for delta in calls[started:]:
            if self.open is None or self.open.call != delta.index:
                item = _call(ToolCall(delta.id, delta.name, ""), "in_progress")
                events += self._add(item, delta.index)
            if delta.arguments:
                events += self._append(delta.arguments)
        return events

    def stream_finish(self, index: int, output: RequestOutput) -> bytes:
        self.finish = output.finish_reason
        if output.usage is not None:
            self.usage = output.usage
        status = "incomplete" if self.finish == FinishReason.LENGTH else "completed"
        events = b""
        if not any(isinstance(item, MessageItem | FunctionCallItem) for item in self.items):
            events += self._close(status) + self._into(MessageItem)  # an empty answer
        return events + self._close(status)

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
        self.items = output_of(choice, self.sealed)
        self.complete(choice.finish_reason, usage)
        return self.encode(self.resp)
