"""ResponseParser on outputs as models write them, in each of mlx-lm's tool-call formats:
answer, thinking and calls apart, whatever the chunking; JSON bodies stream their arguments,
other formats send each call whole; what a parser rejects goes back to the answer."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.chat_templates.muse_spark import RESPONSE_FORMAT as MUSE_FORMAT
from mlx_lm.tokenizer_utils import load as load_tokenizer

from shared.types import Tool
from worker.backends.formats import (
    ModelFormats,
    ToolFormat,
    arguments_object,
    model_formats,
    template_tools,
)
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

# A body each format's parser rejects.
MALFORMED: dict[str, str] = {
    "json_tools": "<tool_call>\nI would call get_weather here\n</tool_call>",
    "qwen3_coder": "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
    "mistral": "[TOOL_CALLS] are how I call tools",
    "pythonic": "<|tool_call_start|>no call here<|tool_call_end|>",
    "kimi_k2": "<|tool_calls_section_begin|>nothing<|tool_calls_section_end|>",
    "minimax_m2": '<minimax:tool_call>\n<parameter name="city">Paris</parameter>\n'
    "</minimax:tool_call>",
    "gemma4": "<|tool_call>get_weather(Paris)<tool_call|>",
    "function_gemma": "<start_function_call>get_weather(Paris)<end_function_call>",
    # glm47's parser takes any text as a call (named "unknown" at worst): nothing to reject
}


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


def assert_no_markup(parser: str, content: str) -> None:
    fmt = tool_format(parser)
    for marker in (fmt.start, fmt.end, "<think>", "</think>"):
        if marker:
            assert marker not in content


def same_in_every_chunking(parser: str, text: str, **kwargs: Any) -> Result:
    whole = run(parser, text, **kwargs)
    for size in CHUNK_SIZES:
        assert run(parser, text, size, **kwargs) == whole, f"chunks of {size}"
    return whole


# ---- each format's recorded outputs --------------------------------------------------------


@pytest.mark.parametrize("parser", FORMATS)
def test_text_then_one_call(parser: str) -> None:
    text = "Let me look that up.\n" + RECORDED[parser].one
    result = same_in_every_chunking(parser, text)
    assert result == Result("Let me look that up.\n", "", [WEATHER_CALL], 1)


@pytest.mark.parametrize("parser", FORMATS)
def test_only_a_call(parser: str) -> None:
    result = same_in_every_chunking(parser, RECORDED[parser].one)
    assert result == Result("", "", [WEATHER_CALL], 1)


@pytest.mark.parametrize("parser", FORMATS)
def test_several_calls_in_one_message(parser: str) -> None:
    result = same_in_every_chunking(parser, RECORDED[parser].two)
    assert result.calls == [WEATHER_CALL, TIME_CALL]
    assert result.count == 2
    assert result.content == ""  # a turn of calls has no (blank) answer
    assert result.reasoning == ""


@pytest.mark.parametrize("parser", FORMATS)
def test_reasoning_then_answer_then_call(parser: str) -> None:
    text = (
        "<think>\nThe user wants Paris's weather.\n</think>\n\nChecking.\n" + RECORDED[parser].one
    )
    result = same_in_every_chunking(parser, text)
    assert result.reasoning == "\nThe user wants Paris's weather.\n"
    assert result.content == "\n\nChecking.\n"
    assert result.calls == [WEATHER_CALL]
    assert_no_markup(parser, result.content)


@pytest.mark.parametrize("parser", FORMATS)
def test_output_that_starts_inside_thinking(parser: str) -> None:
    # DeepSeek-R1-style templates open <think> in the prompt: the output starts in it
    text = "The user wants Paris's weather.\n</think>\n\n" + RECORDED[parser].one
    result = same_in_every_chunking(parser, text, initial="reasoning")
    assert result.reasoning == "The user wants Paris's weather.\n"
    assert result.content == "\n\n"
    assert result.calls == [WEATHER_CALL]


@pytest.mark.parametrize("parser", FORMATS)
def test_answer_after_reasoning_without_calls(parser: str) -> None:
    text = "Hello.</think>It is 3 < 4 and [1] {a: b} <b>bold</b>."
    result = same_in_every_chunking(parser, text, initial="reasoning")
    assert result == Result("It is 3 < 4 and [1] {a: b} <b>bold</b>.", "Hello.", [], 0)


@pytest.mark.parametrize("parser", FORMATS)
def test_call_markup_is_an_answer_without_tools(parser: str) -> None:
    text = "<think>plan</think>Here: " + RECORDED[parser].two
    result = same_in_every_chunking(parser, text, tools=None)
    assert result == Result("Here: " + RECORDED[parser].two, "plan", [], 0)


@pytest.mark.parametrize("parser", sorted(MALFORMED))
def test_a_body_the_parser_rejects_goes_back_to_the_answer(parser: str) -> None:
    # after a format without an end marker, the "call" runs to the end of the output
    text = "Try this: " + MALFORMED[parser] + (" (sorry)" if tool_format(parser).end else "")
    result = same_in_every_chunking(parser, text)
    assert result == Result(text, "", [], 0)


def test_glm47_reads_any_body_as_a_call() -> None:
    # mlx-lm's glm47 parser has no failure: "name rest" is a call of `name` with the raw rest
    result = run("glm47", "<tool_call>just some words</tool_call>")
    assert result.calls == [("just", json.dumps({"raw": "some words"}))]


def test_a_rejected_body_between_calls_keeps_the_calls() -> None:
    bad = "<tool_call>\n<function>\n</tool_call>"
    text = (
        RECORDED["qwen3_coder"].one
        + bad
        + "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    )
    result = same_in_every_chunking("qwen3_coder", text)
    assert result.calls == [WEATHER_CALL, ("get_time", "{}")]
    assert result.content == bad


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


# ---- the parser's state ----------------------------------------------------------------------


@pytest.mark.parametrize("parser", ["json_tools", "qwen3_coder", "glm47", "gemma4"])
def test_single_counts_the_first_call_as_soon_as_it_closes(parser: str) -> None:
    two = RECORDED[parser].two
    one = RECORDED[parser].one
    response = ResponseParser(formats(parser), "normal", TOOLS, single=True)
    assert response.single
    counts = []
    for ch in two:
        response.feed(ch)
        counts.append(response.calls)
    first = counts.index(1)  # the engine stops the turn here
    assert first == len(one) - 1
    assert counts[:first] == [0] * first


def test_single_false_by_default() -> None:
    assert not ResponseParser(formats("json_tools"), "normal", TOOLS).single


def test_in_reasoning_follows_the_markers() -> None:
    response = ResponseParser(formats("json_tools"), "reasoning", TOOLS)
    assert response.in_reasoning
    response.feed("thinking</thi")
    assert response.in_reasoning
    response.feed("nk>answer")
    assert not response.in_reasoning
    response.feed("<think>")
    assert response.in_reasoning


def test_a_call_inside_reasoning_is_a_call() -> None:
    # the machine lets a call start while thinking (models that call from their thoughts)
    text = "I will call it.\n" + RECORDED["json_tools"].one
    result = run("json_tools", text, initial="reasoning")
    assert result == Result("", "I will call it.\n", [WEATHER_CALL], 1)


def test_without_thinking_think_markup_is_an_answer() -> None:
    plain = ModelFormats(tool_format("json_tools"), None, None, None, None, False, None, {})
    response = ResponseParser(plain, "normal", TOOLS)
    pieces = [response.feed("<think>x</think>" + RECORDED["json_tools"].one), response.finish()]
    assert collect(pieces, response.calls) == Result("<think>x</think>", "", [WEATHER_CALL], 1)


def muse_spark() -> ModelFormats:
    """Muse Spark: a response format of its own (mlx-lm's chat_templates), where each
    message opens with a header and calls start from the header."""
    tool = tool_format("muse_spark")
    initial, transitions = MUSE_FORMAT["initial_state"], MUSE_FORMAT["transitions"]
    return ModelFormats(tool, None, None, None, None, False, initial, transitions)


MUSE_CALL = (
    "to=self<|message|>The user wants the weather.<|eom|>"
    "<|start|>assistant to=functions.get_weather<|message|><atem:function_calls>\n"
    '<atem:invoke name="get_weather">\n<atem:parameter name="city">Paris</atem:parameter>\n'
    "</atem:invoke>\n</atem:function_calls><|eom|>"
)
MUSE_ANSWER = (
    "to=self<|message|>A greeting.<|eom|><|start|>assistant to=user<|message|>Hello!<|eot|>"
)


def test_a_response_format_of_its_own() -> None:
    formats = muse_spark()
    assert formats.initial([], None) == "header"
    response = ResponseParser(formats, "header", TOOLS)
    result = collect([response.feed(MUSE_CALL), response.finish()], response.calls)
    assert result.reasoning == "The user wants the weather."
    assert result.calls == [("get_weather", '{"city": "Paris"}')]
    # without tools its call transitions are dropped: the call is text
    untooled = formats.machine(with_tools=False)
    _, segments = untooled.split(untooled.make_state("header"), MUSE_CALL)
    assert all(state != "tool" for state, _ in segments)


@pytest.mark.parametrize(
    ("text", "content"), [(MUSE_CALL, ""), (MUSE_ANSWER, "Hello!")], ids=["call", "answer"]
)
def test_header_text_of_a_response_format_is_not_an_answer(text: str, content: str) -> None:
    response = ResponseParser(muse_spark(), "header", TOOLS)
    result = collect([response.feed(text), response.finish()], response.calls)
    assert result.content == content


# ---- a model's formats from its tokenizer ------------------------------------------------------


def test_model_formats_from_a_generated_model(hermes_model_dir: Path) -> None:
    tokenizer = load_tokenizer(hermes_model_dir)
    found = model_formats(tokenizer)
    assert found.tools is not None and found.tools.parser == "json_tools"
    assert found.tools.json_body
    assert (found.think_start, found.think_end) == ("<think>", "</think>")
    assert found.thinking
    opened = tokenizer.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    closed = tokenizer.encode("<think>\nhm</think>\n", add_special_tokens=False)
    assert found.initial(opened, tokenizer) == "reasoning"
    assert found.initial(closed, tokenizer) == "normal"
    assert found.initial([], tokenizer) == "normal"
    named = model_formats(tokenizer, "pythonic")
    assert named.tools is not None and named.tools.start == "<|tool_call_start|>"
    with pytest.raises(ValueError, match=r"engine\.tool_parser"):
        model_formats(tokenizer, "no_such_parser")


def test_template_tools_and_arguments_object() -> None:
    tools = [Tool("f", "does f", {"type": "object", "properties": {"a": {"type": "string"}}})]
    assert template_tools([*tools, Tool("g")]) == [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": "does f",
                "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
            },
        },
        {
            "type": "function",
            "function": {
                "name": "g",
                "description": "",
                "parameters": {"type": "object", "properties": {}},
            },
        },
    ]
    assert arguments_object('{"a": [1]}') == {"a": [1]}
    assert arguments_object("not json") == "not json"


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
