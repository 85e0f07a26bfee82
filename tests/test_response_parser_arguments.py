"""ResponseParser on a call's arguments: JSON bodies stream them as the model wrote them,
other formats send each call whole, values follow the tool's schema; an output cut short
keeps what can be read; and the parser bugs once found in arguments and placement."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.response_parser_helpers import (
    CHUNK_SIZES,
    RECORDED,
    TIME_CALL,
    TOOLS,
    WEATHER_CALL,
    Result,
    chunked,
    collect,
    formats,
    run,
    same_in_every_chunking,
)
from worker.parsing.response import Parsed, ResponseParser

# ---- arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize("size", (None, *CHUNK_SIZES))
def test_json_arguments_are_the_text_the_model_wrote(size: int | None) -> None:
    text = (
        '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris" , "days":3}}\n</tool_call>'
    )
    result = run("json_tools", text, size)
    assert result.calls == [("get_weather", '{"city":"Paris" , "days":3}')]


def test_json_arguments_stream_before_the_call_closes() -> None:
    one = RECORDED["json_tools"].one
    body_end = one.index("</tool_call>")
    response = ResponseParser(formats("json_tools"), "normal", TOOLS)
    pieces = [response.feed(chunk) for chunk in chunked(one[:body_end], 3)]
    streamed = collect(pieces, response.calls)
    assert streamed.calls == [("get_weather", '{"city": "Paris", "days": 3}')]
    assert response.calls == 0  # not complete yet
    # the name came before its arguments were complete, fragments in several deltas
    first_fragment = next(i for i, p in enumerate(pieces) if any(d.arguments for d in p.calls))
    named = next(i for i, p in enumerate(pieces) if any(d.name for d in p.calls))
    assert named <= first_fragment
    fragments = [d.arguments for p in pieces for d in p.calls if d.arguments]
    assert len(fragments) > 3
    last = response.feed(one[body_end:])
    assert last == Parsed()  # nothing more to send: the call was streamed
    assert response.calls == 1


def test_the_second_json_call_streams_under_its_own_index() -> None:
    response = ResponseParser(formats("json_tools"), "normal", TOOLS)
    one = RECORDED["json_tools"].one
    first = response.feed(one + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Eu')
    assert [(d.index, bool(d.id), d.name, d.arguments) for d in first.calls] == [
        (0, True, "get_weather", ""),
        (0, False, "", '{"city": "Paris", "days": 3}'),
        (1, True, "get_time", ""),
        (1, False, "", '{"tz": "Eu'),
    ]
    assert response.calls == 1


@pytest.mark.parametrize("parser", ["qwen3_coder", "minimax_m2", "kimi_k2", "pythonic"])
def test_other_formats_send_each_call_whole_when_complete(parser: str) -> None:
    one = RECORDED[parser].one
    response = ResponseParser(formats(parser), "normal", TOOLS)
    before = [response.feed(ch) for ch in one[:-1]]
    assert all(not p.calls for p in before)
    last = response.feed(one[-1])
    assert [(d.index, d.name, d.arguments) for d in last.calls] == [
        (0, "get_weather", ""),
        (0, "", WEATHER_CALL[1]),
    ]


def test_mistral_calls_complete_at_the_end_of_the_output() -> None:
    response = ResponseParser(formats("mistral"), "normal", TOOLS)
    assert response.feed(RECORDED["mistral"].two).calls == []
    result = collect([response.finish()], response.calls)
    assert result.calls == [WEATHER_CALL, TIME_CALL]


def test_mistral_json_list_form() -> None:
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'
    assert same_in_every_chunking("mistral", text).calls == [WEATHER_CALL]


@pytest.mark.parametrize(
    ("tools", "arguments"),
    [
        (TOOLS, {"city": "Paris", "days": 3, "zip": "75001"}),
        ([], {"city": "Paris", "days": "3", "zip": "75001"}),  # no schema: text stays text
    ],
)
def test_qwen3_coder_values_are_converted_by_the_schema(
    tools: list[dict[str, Any]], arguments: dict[str, Any]
) -> None:
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    assert run("qwen3_coder", text, tools=tools).calls == [("get_weather", json.dumps(arguments))]


def test_glm47_keeps_schema_strings_as_strings() -> None:
    text = (
        "<tool_call>get_weather\n<arg_key>zip</arg_key>\n<arg_value>75001</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    )
    with_schema = run("glm47", text).calls
    without = run("glm47", text, tools=[]).calls
    assert with_schema == [("get_weather", json.dumps({"zip": "75001", "days": 3}))]
    assert without == [("get_weather", json.dumps({"zip": 75001, "days": 3}))]


def test_non_ascii_arguments_are_not_escaped() -> None:
    text = '<|tool_call_start|>[get_weather(city="Zürich")]<|tool_call_end|>'
    assert run("pythonic", text).calls == [("get_weather", '{"city": "Zürich"}')]


def test_a_streamed_json_call_the_parser_rejects_stays_a_call() -> None:
    # its name and arguments were sent as they came: the client has what was generated
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    result = same_in_every_chunking("json_tools", text)
    assert result == Result("", "", [("get_weather", '{"city": Paris}')], 1)


# ---- output cut short ------------------------------------------------------------------------


@pytest.mark.parametrize("size", (None, *CHUNK_SIZES))
def test_json_call_cut_short_keeps_what_was_streamed(size: int | None) -> None:
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    result = run("json_tools", text, size)
    assert result == Result("Sure.\n", "", [("get_weather", '{"city": "Par')], 1)


@pytest.mark.parametrize("parser", ["qwen3_coder", "pythonic", "minimax_m2", "gemma4"])
def test_call_cut_short_that_cannot_be_read_is_dropped(parser: str) -> None:
    one = RECORDED[parser].one
    text = "Sure.\n" + one[: len(one) * 2 // 3]
    result = same_in_every_chunking(parser, text)
    assert result == Result("Sure.\n", "", [], 0)


def test_call_cut_short_after_its_body_is_still_a_call() -> None:
    one = RECORDED["qwen3_coder"].one
    text = one[: one.index("</tool_call>")]  # the end marker never came
    result = same_in_every_chunking("qwen3_coder", text)
    assert result == Result("", "", [WEATHER_CALL], 1)


def test_reasoning_cut_short_flushes_held_text() -> None:
    # "</thi" may be the start of the end marker: held back until the output ends
    result = same_in_every_chunking("json_tools", "<think>I wonder </thi", initial="normal")
    assert result == Result("", "I wonder </thi", [], 0)


def test_answer_cut_on_a_marker_prefix_flushes_held_text() -> None:
    result = same_in_every_chunking("json_tools", "a <tool_c")
    assert result == Result("a <tool_c", "", [], 0)


# ---- bugs --------------------------------------------------------------------------------------


def test_json_call_without_arguments_has_empty_object_arguments() -> None:
    result = run("json_tools", '<tool_call>\n{"name": "get_time"}\n</tool_call>')
    assert result.calls == [("get_time", "{}")]


def test_arguments_are_always_json_text() -> None:
    text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": Paris}<|tool_call_end|>'
        "<|tool_calls_section_end|>"
    )
    [(name, arguments)] = run("kimi_k2", text).calls
    assert name == "get_weather"
    json.loads(arguments)


def test_blank_between_a_call_and_a_rejected_body_keeps_its_place() -> None:
    text = RECORDED["json_tools"].one + "\n<tool_call>\nnot json\n</tool_call>\nDone."
    result = run("json_tools", text)
    assert result.content == "\n<tool_call>\nnot json\n</tool_call>\nDone."
