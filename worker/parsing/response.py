"""One request's output split into answer, thinking and tool calls, as it streams.

mlx-lm's TextStateMachine (built in worker/backends/formats.py) follows the model's markers
in the decoded text (holding back what may be the start of one) and says which state each
piece of text belongs to; this turns the pieces into the deltas clients see. Call markup
never reaches the answer: a call in a JSON body streams its name and arguments as they are
generated (call_stream.py); any other format sends each call whole when it is complete,
parsed by mlx-lm's parser.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from shared.types import ToolCallDelta
from worker.backends.formats import CALL_STATES, ModelFormats
from worker.parsing.call_stream import CallStream


@dataclass(slots=True)
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls += other.calls
        return self


class ResponseParser:
    def __init__(
        self,
        formats: ModelFormats,
        initial: str,
        tools: list[dict[str, Any]] | None = None,
        single: bool = False,
    ) -> None:
        """`tools` (OpenAI's function shape, for the parser's type conversions): the
        request's tools; None reads no calls (their markup stays in the answer). `single`:
        the turn ends with its first call (parallel_tool_calls false)."""
        self.formats = formats
        self.single = single
        self.tool_format = formats.tools if tools is not None else None
        self.tools = tools
        self.machine = formats.machine(self.tool_format is not None)
        self.state = self.machine.make_state(initial)
        self.calls = 0  # complete calls so far
        self._body = ""  # the open call's text
        self._stream: CallStream | None = None
        self._id = ""
        self._in_call = False
        self._blank = ""  # whitespace after a call, held back

    @property
    def in_reasoning(self) -> bool:
        return self.state[0] == "reasoning"

    def feed(self, text: str) -> Parsed:
        parsed = Parsed()
        if not text:
            return parsed
        self.state, segments = self.machine.split(self.state, text)
        last = len(segments) - 1
        for i, (state, piece) in enumerate(segments):
            if state in CALL_STATES:
                parsed += self._call_text(piece)
                if i < last:  # its end marker came
                    parsed += self._close_call()
            elif state == "reasoning":
                parsed.reasoning += piece
            elif state == "normal":
                parsed.content += self._answer(piece)
            # other states are a response format's own (headers): not the answer
        return parsed

    def _answer(self, piece: str) -> str:
        """Answer text; blank text after a call (between calls, before the end) is held
        until more answer follows: a turn of calls has no blank answer."""
        if self.calls and not (self._blank + piece).strip():
            self._blank += piece
            return ""
        piece, self._blank = self._blank + piece, ""
        return piece

    def finish(self) -> Parsed:
        """The end of the output: text held back as a possible marker, and a call still
        open (a format without an end marker, or a call cut short)."""
        self.state, tail, state = self.machine.flush(self.state)
        parsed = Parsed()
        if state in CALL_STATES:
            parsed += self._call_text(tail)
        elif state == "reasoning":
            parsed.reasoning += tail
        elif state == "normal":
            parsed.content += self._answer(tail)
        if self._in_call:
            fmt = self.tool_format
            parsed += self._close_call(cut=fmt is not None and bool(fmt.end))
        return parsed

    # ---- calls ------------------------------------------------------------------------

    def _call_text(self, piece: str) -> Parsed:
        parsed = Parsed()
        if not self._in_call:
            self._in_call, self._body = True, ""
            self._id = f"call_{uuid.uuid4().hex[:24]}"
            fmt = self.tool_format
            self._stream = CallStream() if fmt is not None and fmt.json_body else None
        self._body += piece
        stream = self._stream
        if stream is not None:
            had_name = stream.name is not None
            stream.feed(piece)
            if stream.name is not None and not had_name:
                parsed.calls.append(ToolCallDelta(self.calls, self._id, stream.name))
            fragment = stream.take()
            if fragment:
                parsed.calls.append(ToolCallDelta(self.calls, arguments=fragment))
        return parsed

    def _close_call(self, cut: bool = False) -> Parsed:
        """The open call is complete (or `cut` short: the output ended before its end
        marker): parsed by mlx-lm's parser for the model's format. A call cut short that
        cannot be parsed is dropped: its markup never reaches the answer."""
        self._in_call = False
        body, stream = self._body, self._stream
        parsed = Parsed()
        calls = self._parse(body)
        if stream is not None and stream.name is not None:
            # streamed already: its pieces are the call (a parse failure here means the
            # output was cut short; the client has what was generated)
            if calls and not stream.sent:
                # arguments not streamed (none, a string, a scalar): what the parser read
                parsed.calls.append(ToolCallDelta(self.calls, arguments=calls[0][1]))
            if not stream.complete or not calls:
                self.calls += 1
                return parsed
            rest = calls[1:]  # a body holding more than one call (rare)
            self.calls += 1
        else:
            if not calls and cut:
                return parsed
            if not calls:  # not a call after all: the text goes to the answer
                fmt = self.tool_format
                assert fmt is not None
                parsed.content += self._answer(fmt.start + body + (fmt.end if fmt.end else ""))
                return parsed
            rest = calls
        for call in rest:
            name, arguments = call
            parsed.calls.append(
                ToolCallDelta(self.calls, self._id if not parsed.calls else _new_id(), name)
            )
            parsed.calls.append(ToolCallDelta(self.calls, arguments=arguments))
            self.calls += 1
        return parsed

    def _parse(self, body: str) -> list[tuple[str, str]]:
        fmt = self.tool_format
        assert fmt is not None
        try:
            result = fmt.parse(body, self.tools)
        except Exception:  # any parser's complaint: not a call
            return []
        items = result if isinstance(result, list) else [result]
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return []
            arguments = item.get("arguments", {})
            if arguments is None:
                arguments = {}
            if isinstance(arguments, str):
                try:  # the arguments' JSON text (a parser's or a model's): the object
                    decoded = json.loads(arguments)
                except ValueError:
                    decoded = arguments
                arguments = json.dumps({} if decoded is None else decoded, ensure_ascii=False)
            else:
                arguments = json.dumps(arguments, ensure_ascii=False)
            calls.append((item["name"], arguments))
        return calls


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
