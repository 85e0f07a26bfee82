"""ResponseParser on outputs as models write them, in each of mlx-lm's tool-call formats:
answer, thinking and calls apart, whatever the chunking; what a parser rejects goes back to
the answer; the parser's state (one call only, in reasoning or not), and a model's response
format of its own."""

from __future__ import annotations

import json

import pytest
from mlx_lm.chat_templates.muse_spark import RESPONSE_FORMAT as MUSE_FORMAT

from tests.response_parser_helpers import (
    FORMATS,
    RECORDED,
    TIME_CALL,
    TOOLS,
    WEATHER_CALL,
    Result,
    collect,
    formats,
    run,
    same_in_every_chunking,
    tool_format,
)
from worker.backends.formats import ModelFormats
from worker.parsing.response import ResponseParser

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


def assert_no_markup(parser: str, content: str) -> None:
    fmt = tool_format(parser)
    for marker in (fmt.start, fmt.end, "<think>", "</think>"):
        if marker:
            assert marker not in content


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
def test_a_call_made_while_thinking_leaves_the_thinking_thinking(parser: str) -> None:
    # a call inside the think block: the thinking after it (and its end marker) is still
    # thinking, not the answer
    if not tool_format(parser).end:
        pytest.skip("a call without an end marker runs to the end of the output")
    text = "Paris, then. " + RECORDED[parser].one + " Done.</think>It is sunny."
    result = same_in_every_chunking(parser, text, initial="reasoning")
    assert result.calls == [WEATHER_CALL]
    assert result.reasoning == "Paris, then.  Done."
    assert result.content == "It is sunny."


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
