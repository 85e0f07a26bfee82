"""A model's output formats: how its template marks thinking and tool calls, and the mlx-lm
parser that reads its calls. mlx-lm infers both when it loads the tokenizer (from the chat
template's markers and the vocabulary); `engine.tool_parser` names another of its parsers."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from mlx_lm.generate import TextStateMachine

# Tool-call bodies that are one JSON object {"name": ..., "arguments": {...}} per call
# between the markers: their arguments stream as they are generated, and a forced call
# is constrained in this native form.
JSON_CALL_FORMATS = frozenset({"json_tools"})
# Calls as XML (<function=NAME><parameter=KEY>VALUE</parameter></function>): a forced call
# is constrained in this form too; each call is sent whole once it is complete.
XML_CALL_FORMATS = frozenset({"qwen3_coder"})


# a think block closed within the prompt's last tokens was closed by the template (the
# end marker and the blank lines after it): thinking is off for this answer
CLOSED_TAIL = 4
# the state of a call's markup inside the think block (its end returns to the thinking)
THINKING_CALL = "reasoning_tool"
CALL_STATES = frozenset({"tool", THINKING_CALL})


@dataclass(frozen=True, slots=True)
class ToolFormat:
    parser: str  # mlx-lm's parser module name
    start: str
    end: str  # "" when calls run to the end of the output (mistral)
    parse: Callable[..., Any]
    start_token: int | None = None  # the start marker's id where it is one token

    @property
    def json_body(self) -> bool:
        return self.parser in JSON_CALL_FORMATS


@dataclass(frozen=True, slots=True)
class ModelFormats:
    tools: ToolFormat | None
    think_start: str | None
    think_end: str | None
    think_start_tokens: tuple[int, ...] | None
    think_end_tokens: tuple[int, ...] | None
    takes_effort: bool  # the template reads `reasoning_effort`
    initial_state: str | None  # a response format's first state (mlx-lm's chat_templates)
    transitions: dict[str, list[tuple[str, str]]]
    markers: tuple[str, ...] = ()  # structural markers stripped from the answer (XTML)

    @property
    def marked(self) -> bool:
        """The output has markers to follow even without tools (thinking, a response
        format's states, structural markers)."""
        return self.thinking or bool(self.transitions) or bool(self.markers)

    @property
    def thinking(self) -> bool:
        return self.think_start is not None and bool(self.think_end_tokens)

    def initial(self, prompt: list[int], tokenizer: Any) -> str:
        """The state the output starts in: inside thinking when the prompt opened a think
        block it did not close (a template that starts the answer with `<think>`)."""
        if self.initial_state is not None:
            return self.initial_state
        if self.thinking:
            start = tokenizer.rfind_think_start(prompt)
            if start >= 0 and start > tokenizer.rfind_think_end(prompt):
                return "reasoning"
        return "normal"

    def opens_thinking(self, prompt: list[int], tokenizer: Any) -> bool:
        """The output may open a think block itself: a thinking model whose prompt neither
        opened one (the output starts inside it) nor closed an empty one at its end (a
        template's way of turning thinking off, as Qwen3's `enable_thinking=False`)."""
        if not self.thinking or self.initial(prompt, tokenizer) != "normal":
            return False
        end = tokenizer.rfind_think_end(prompt)
        return end < 0 or end < len(prompt) - CLOSED_TAIL

    def machine(self, with_tools: bool) -> TextStateMachine:
        """mlx-lm's text state machine over this model's markers; with_tools False leaves
        call markup in the answer (the request gave no tools)."""
        transitions: dict[str, list[tuple[str, str]]] = {}
        if self.thinking:
            assert self.think_start is not None and self.think_end is not None
            transitions["normal"] = [(self.think_start, "reasoning")]
            transitions["reasoning"] = [(self.think_end, "normal")]
        if with_tools and self.tools is not None:
            targets = {dst for edges in self.transitions.values() for _, dst in edges}
            if "tool" not in targets:
                transitions.setdefault("normal", []).append((self.tools.start, "tool"))
            transitions["tool"] = [(self.tools.end, "normal")] if self.tools.end else []
            if self.thinking:  # a call made while thinking: the thinking goes on after it
                transitions["reasoning"].append((self.tools.start, THINKING_CALL))
                end = [(self.tools.end, "reasoning")] if self.tools.end else []
                transitions[THINKING_CALL] = end
        for marker in self.markers:
            transitions.setdefault("normal", []).append((marker, "normal"))
        for state, edges in self.transitions.items():
            if not with_tools:
                edges = [(text, dst) for text, dst in edges if dst != "tool"]
            transitions.setdefault(state, []).extend(edges)
        return TextStateMachine(transitions or None)


def model_formats(tokenizer: Any, tool_parser: str | None = None) -> ModelFormats:
    """What mlx-lm's TokenizerWrapper found in the model (or `tool_parser`, configured)."""
    tools = _tool_format(tokenizer, tool_parser)
    template = getattr(tokenizer, "chat_template", None)
    think_start = getattr(tokenizer, "think_start", None)
    return ModelFormats(
        tools=tools,
        think_start=think_start,
        think_end=getattr(tokenizer, "think_end", None) if think_start else None,
        think_start_tokens=tuple(tokenizer.think_start_tokens or ()) if think_start else None,
        think_end_tokens=tuple(tokenizer.think_end_tokens or ()) if think_start else None,
        takes_effort=isinstance(template, str) and "reasoning_effort" in template,
        initial_state=getattr(tokenizer, "response_initial_state", None),
        transitions=dict(getattr(tokenizer, "response_transitions", None) or {}),
        markers=tuple(getattr(tokenizer, "structural_markers", None) or ()),
    )


def _tool_format(tokenizer: Any, name: str | None) -> ToolFormat | None:
    found = _named_format(tokenizer, name)
    if found is None:
        return None
    ids = tokenizer.encode(found.start, add_special_tokens=False)
    return replace(found, start_token=ids[0]) if len(ids) == 1 else found


def _named_format(tokenizer: Any, name: str | None) -> ToolFormat | None:
    if name is not None:
        try:
            module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
        except ImportError:
            raise ValueError(
                f"engine.tool_parser: mlx-lm has no tool parser {name!r} (see mlx_lm/tool_parsers)"
            ) from None
        return ToolFormat(
            name, module.tool_call_start, module.tool_call_end, module.parse_tool_call
        )
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    detected = (getattr(tokenizer, "init_kwargs", None) or {}).get("tool_parser_type", "")
    return ToolFormat(
        str(detected),
        tokenizer.tool_call_start,
        tokenizer.tool_call_end or "",
        tokenizer.tool_parser,
    )


def template_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Tools as chat templates (and mlx-lm's parsers) expect them: OpenAI's function shape."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters or {"type": "object", "properties": {}},
            },
        }
        for t in tools
    ]


def arguments_object(arguments: str) -> Any:
    """A history call's arguments for the template: the parsed object (templates render
    `tool_call.arguments | tojson` or iterate its items), the text when it is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
