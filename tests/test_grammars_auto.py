"""Grammars under tool_choice auto: the model decides whether to call, and what must hold
all the same does: a strict tool's arguments (any text, then calls valid against the
tools' schemas) and a response format beside tools (that JSON, or calls). Run by
llguidance matchers over generated models' real tokenizers."""

from __future__ import annotations

import json

import pytest

from shared.types import OutputFormat, ResponseFormat, Tool, ToolChoice, ToolChoiceMode
from tests import test_grammars
from tests.test_grammars import (
    SCHEMA_FORMAT,
    TIME,
    TIME_CALL,
    TOOLS,
    WEATHER,
    WEATHER_CALL,
    Model,
    coder_call,
    hermes_call,
    tool_format,
)
from worker.backends.formats import ToolFormat
from worker.structured.grammars import GrammarError, tool_grammar

AUTO = ToolChoice(ToolChoiceMode.AUTO)
ONE = ToolChoice(ToolChoiceMode.AUTO, parallel=False)
BAD_CALL = hermes_call("get_weather", {"city": "Paris", "days": "three"})


# test_grammars' fixtures, by name: the generated models' tokenizers and their grammars
hermes = test_grammars.hermes
coder = test_grammars.coder


def auto(
    model: Model,
    fmt: ToolFormat,
    tools: list[Tool] = TOOLS,
    choice: ToolChoice = AUTO,
    answer: ResponseFormat | None = None,
) -> str:
    grammar = tool_grammar(tools, choice, fmt, model.grammars.literal, answer)
    assert grammar is not None
    return grammar


# ---- a strict tool: any text, then calls held to the schemas ---------------------------------


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="nothing"),
        pytest.param("It is sunny in Paris.\nAnything else?", id="text"),
        pytest.param(WEATHER_CALL, id="a-call"),
        pytest.param("Let me look.\n" + WEATHER_CALL, id="text-then-call"),
        pytest.param(WEATHER_CALL + "\n" + TIME_CALL, id="two-calls"),
    ],
)
def test_a_strict_tool_under_auto_leaves_text_and_valid_calls(hermes: Model, text: str) -> None:
    assert hermes.accepts(auto(hermes, tool_format("json_tools")), text)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(BAD_CALL, id="wrong-type"),
        pytest.param("Let me look.\n" + hermes_call("get_news", {}), id="unknown-tool"),
        pytest.param(WEATHER_CALL + " Done.", id="text-after-a-call"),
    ],
)
def test_a_strict_tool_under_auto_refuses_invalid_calls(hermes: Model, text: str) -> None:
    assert hermes.refuses(auto(hermes, tool_format("json_tools")), text)


def test_parallel_calls_off_under_auto_allow_one_call(hermes: Model) -> None:
    grammar = auto(hermes, tool_format("json_tools"), choice=ONE)
    matcher = hermes.feed(grammar, "Sure.\n" + WEATHER_CALL)
    assert matcher.is_accepting() and matcher.is_stopped()
    assert hermes.refuses(grammar, WEATHER_CALL + "\n" + TIME_CALL)


def test_qwen3_coder_calls_under_auto(coder: Model) -> None:
    grammar = auto(coder, tool_format("qwen3_coder"))
    good = coder_call("get_weather", {"city": "Paris", "days": "3"})
    assert coder.accepts(grammar, "I will check.\n" + good)
    assert coder.accepts(grammar, "No call needed.")
    assert coder.refuses(grammar, "I will check.\n" + coder_call("get_weather", {"days": "x"}))


# A marker of plain text (no added token): text runs up to it, and what follows is a call.
PLAIN = ToolFormat("json_tools", "[call-1]", "[/call-1]", tool_format("json_tools").parse)


def plain_call(name: str, arguments: dict[str, object]) -> str:
    return f"[call-1]\n{json.dumps({'name': name, 'arguments': arguments})}\n[/call-1]"


def test_a_plain_text_marker_under_auto(hermes: Model) -> None:
    assert hermes.grammars.literal("[call-1]") == json.dumps("[call-1]")  # not one token
    grammar = auto(hermes, PLAIN)
    good = plain_call("get_weather", {"city": "Paris", "days": 3})
    assert hermes.accepts(grammar, "Plain [call] text (no marker).")
    assert hermes.accepts(grammar, "Checking.\n" + good)
    assert hermes.accepts(grammar, good + "\n" + plain_call("get_time", {"tz": "UTC"}))
    assert hermes.refuses(grammar, "Checking.\n" + plain_call("get_weather", {"city": "P"}))
    assert hermes.refuses(grammar, "Checking [call-1] by hand")
    one = auto(hermes, PLAIN, choice=ONE)
    matcher = hermes.feed(one, "Checking.\n" + good)
    assert matcher.is_accepting() and matcher.is_stopped()
    assert hermes.refuses(one, good + "\n" + good)


def test_mistral_calls_under_auto(hermes: Model) -> None:
    """[TOOL_CALLS] is plain text in this vocabulary: the plain-marker grammar."""
    grammar = auto(hermes, tool_format("mistral"))
    calls = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]
    assert hermes.accepts(grammar, "Sure.")
    assert hermes.accepts(grammar, "Sure.[TOOL_CALLS]" + json.dumps(calls))
    wrong = [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert hermes.refuses(grammar, "Sure.[TOOL_CALLS]" + json.dumps(wrong))


# ---- a response format beside tools: that JSON, or calls -----------------------------------


@pytest.mark.parametrize("tools", [[TIME], TOOLS], ids=["lenient", "strict"])
def test_a_response_format_beside_tools_is_that_json_or_calls(
    hermes: Model, tools: list[Tool]
) -> None:
    grammar = auto(hermes, tool_format("json_tools"), tools, answer=SCHEMA_FORMAT)
    matcher = hermes.feed(grammar, json.dumps({"city": "Paris", "days": 3}))
    assert matcher.is_accepting() and matcher.is_stopped()
    assert hermes.accepts(grammar, TIME_CALL)
    assert hermes.refuses(grammar, "Sure: " + json.dumps({"city": "Paris", "days": 3}))
    assert hermes.refuses(grammar, json.dumps({"city": "Paris"}))  # not the format's JSON


def test_json_object_or_mistral_calls(hermes: Model) -> None:
    grammar = auto(
        hermes, tool_format("mistral"), [TIME], answer=ResponseFormat(OutputFormat.JSON_OBJECT)
    )
    assert hermes.accepts(grammar, json.dumps({"any": ["thing"]}))
    call = [{"name": "get_time", "arguments": {"tz": "UTC"}}]
    assert hermes.accepts(grammar, "[TOOL_CALLS]" + json.dumps(call))
    assert hermes.refuses(grammar, "[1, 2]")


# ---- what cannot be held is a 400 naming it ----------------------------------------------------


@pytest.mark.parametrize("parser", ["pythonic", "glm47"])
def test_a_format_that_cannot_be_constrained_under_auto_is_an_error(parser: str) -> None:
    with pytest.raises(GrammarError, match="strict false") as strict:
        tool_grammar([WEATHER], AUTO, tool_format(parser))
    assert strict.value.param == "tools"
    with pytest.raises(GrammarError, match="response format") as answer:
        tool_grammar([TIME], AUTO, tool_format(parser), answer=SCHEMA_FORMAT)
    assert answer.value.param == SCHEMA_FORMAT.param
    with pytest.raises(GrammarError) as no_format:
        tool_grammar([WEATHER], AUTO, None)
    assert no_format.value.param == "tools"


# ---- mistral's two call forms: a list, or NAME[ARGS]{...} (its v11 templates) -------------


def headed(name: str, arguments: dict[str, object]) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(arguments)}"


@pytest.mark.parametrize("mode", [ToolChoiceMode.REQUIRED, ToolChoiceMode.AUTO])
def test_mistral_calls_in_the_header_form(hermes: Model, mode: ToolChoiceMode) -> None:
    grammar = auto(hermes, tool_format("mistral"), choice=ToolChoice(mode))
    weather = headed("get_weather", {"city": "Paris", "days": 3})
    time_call = headed("get_time", {"tz": "UTC"})
    lead = "" if mode is ToolChoiceMode.REQUIRED else "Checking. "
    assert hermes.accepts(grammar, lead + weather)
    assert hermes.accepts(grammar, lead + weather + time_call)  # the marker before each
    assert hermes.refuses(grammar, lead + headed("get_weather", {"city": "Paris"}))
    assert hermes.refuses(grammar, lead + headed("get_news", {}))
    one = auto(hermes, tool_format("mistral"), choice=ToolChoice(mode, parallel=False))
    matcher = hermes.feed(one, lead + weather)
    assert matcher.is_accepting() and matcher.is_stopped()
    assert hermes.refuses(one, lead + weather + time_call)


def test_best_effort_serves_a_strict_tool_unconstrained_where_none_can_be() -> None:
    """engine.strict_tools = "best_effort": the operator's choice, for strict tools under
    auto only; a forced choice and a format beside tools are still refused."""
    fmt = tool_format("pythonic")
    assert tool_grammar([WEATHER], AUTO, fmt, best_effort=True) is None
    with pytest.raises(GrammarError, match="best_effort"):
        tool_grammar([WEATHER], AUTO, fmt)
    with pytest.raises(GrammarError):
        tool_grammar([WEATHER], ToolChoice(ToolChoiceMode.REQUIRED), fmt, best_effort=True)
    with pytest.raises(GrammarError):
        tool_grammar([WEATHER], AUTO, fmt, answer=SCHEMA_FORMAT, best_effort=True)
    assert tool_grammar([WEATHER], AUTO, tool_format("json_tools"), best_effort=True)
