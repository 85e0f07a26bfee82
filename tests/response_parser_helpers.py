"""Helpers for the ResponseParser tests: two tools, each of mlx-lm's tool-call formats
with a recorded output calling one and two of them, and a run of the parser over an output
in chunks, its deltas joined and checked."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Any

from worker.backends.formats import ModelFormats, ToolFormat
from worker.parsing.response import Parsed, ResponseParser

CHUNK_SIZES = (1, 2, 3, 7)

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "zip": {"type": "string"},
            },
            "required": ["city"],
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}
TOOLS = [WEATHER, TIME]

# The calls every recorded output below makes, as mlx-lm's parsers read them.
WEATHER_CALL = ("get_weather", json.dumps({"city": "Paris", "days": 3}))
TIME_CALL = ("get_time", json.dumps({"tz": "Europe/Paris"}))


@dataclass(frozen=True)
class Recorded:
    one: str  # a call of get_weather(city="Paris", days=3)
    two: str  # that call, then get_time(tz="Europe/Paris"), in one message


RECORDED: dict[str, Recorded] = {
    # Hermes / Qwen2.5 / Qwen3
    "json_tools": Recorded(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        "</tool_call>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'
        "\n</tool_call>",
    ),
    "qwen3_coder": Recorded(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=tz>\nEurope/Paris\n</parameter>\n"
        "</function>\n</tool_call>",
    ),
    # Mistral (v11 tokenizers): no end marker, the calls run to the end of the output
    "mistral": Recorded(
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris"}',
    ),
    # LFM2: Python calls in a list
    "pythonic": Recorded(
        '<|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|>',
        '<|tool_call_start|>[get_weather(city="Paris", days=3), get_time(tz="Europe/Paris")]'
        "<|tool_call_end|>",
    ),
    "glm47": Recorded(
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
        "<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>Europe/Paris</arg_value>\n"
        "</tool_call>",
    ),
    # Kimi K2: one section holding each call
    "kimi_k2": Recorded(
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
        "<|tool_call_begin|>functions.get_time:1"
        '<|tool_call_argument_begin|>{"tz": "Europe/Paris"}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
    ),
    "minimax_m2": Recorded(
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
        '</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>',
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
        '</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n'
        '<invoke name="get_time">\n<parameter name="tz">Europe/Paris</parameter>\n</invoke>\n'
        "</minimax:tool_call>",
    ),
    "gemma4": Recorded(
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
        '<|tool_call>call:get_time{tz:<|"|>Europe/Paris<|"|>}<tool_call|>',
    ),
    "function_gemma": Recorded(
        "<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}"
        "<end_function_call>",
        "<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}"
        "<end_function_call><start_function_call>call:get_time{tz:<escape>Europe/Paris<escape>}"
        "<end_function_call>",
    ),
}
FORMATS = list(RECORDED)


def tool_format(parser: str) -> ToolFormat:
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    return ToolFormat(parser, module.tool_call_start, module.tool_call_end, module.parse_tool_call)


def formats(parser: str) -> ModelFormats:
    """The parser's markers, and <think> blocks (dummy token ids: only the text matters)."""
    return ModelFormats(tool_format(parser), "<think>", "</think>", (901,), (902,), False, None, {})


def chunked(text: str, size: int | None) -> list[str]:
    if size is None:
        return [text]
    return [text[i : i + size] for i in range(0, len(text), size)]


@dataclass(frozen=True)
class Result:
    content: str
    reasoning: str
    calls: list[tuple[str, str]]  # (name, arguments joined), by index
    count: int  # the parser's complete calls


def collect(pieces: list[Parsed], count: int) -> Result:
    """Join the deltas, checking the protocol: a call's first delta has its id and name
    (indices in order, ids unique), the later ones only argument fragments."""
    names: list[str] = []
    arguments: list[str] = []
    ids: set[str] = set()
    for delta in (d for p in pieces for d in p.calls):
        if delta.index == len(names):  # a new call
            assert delta.id.startswith("call_") and delta.id not in ids
            assert delta.name
            ids.add(delta.id)
            names.append(delta.name)
            arguments.append(delta.arguments)
        else:
            assert delta.index == len(names) - 1, "a delta of a call before the last"
            assert delta.id == "" and delta.name == ""
            arguments[delta.index] += delta.arguments
    return Result(
        "".join(p.content for p in pieces),
        "".join(p.reasoning for p in pieces),
        list(zip(names, arguments, strict=True)),
        count,
    )


def run(
    parser: str,
    text: str,
    size: int | None = None,
    tools: list[dict[str, Any]] | None = TOOLS,
    initial: str = "normal",
    single: bool = False,
) -> Result:
    response = ResponseParser(formats(parser), initial, tools, single)
    pieces = [response.feed(chunk) for chunk in chunked(text, size)]
    pieces.append(response.finish())
    return collect(pieces, response.calls)


def same_in_every_chunking(parser: str, text: str, **kwargs: Any) -> Result:
    whole = run(parser, text, **kwargs)
    for size in CHUNK_SIZES:
        assert run(parser, text, size, **kwargs) == whole, f"chunks of {size}"
    return whole
