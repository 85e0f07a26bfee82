"""Grammars of structured output and forced tool calls, run by llguidance matchers over a
generated model's real tokenizer: the tokens of a valid text are accepted, the rest are not."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer

from shared.types import OutputFormat, ResponseFormat, Tool, ToolChoice, ToolChoiceMode
from worker.backends.formats import ToolFormat
from worker.structured.grammars import GrammarError, json_grammar, response_grammar, tool_grammar
from worker.structured.guide import Grammars

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = Tool("get_weather", "The weather in a city", WEATHER_SCHEMA, strict=True)
TIME = Tool(
    "get_time",
    "The time in a zone",
    {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
)
TOOLS = [WEATHER, TIME]
REQUIRED = ToolChoice(ToolChoiceMode.REQUIRED)


def tool_format(parser: str) -> ToolFormat:
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    return ToolFormat(parser, module.tool_call_start, module.tool_call_end, module.parse_tool_call)


@dataclass(frozen=True)
class Model:
    """A generated model's tokenizer and its compiled grammars."""

    tokenizer: TokenizerWrapper
    grammars: Grammars

    def feed(self, grammar: str, text: str) -> Any:
        """A fresh matcher for `grammar` after the tokens of `text`, consumed one at a
        time until one is refused."""
        matcher = self.grammars.matcher(grammar)
        for token in self.tokenizer.encode(text, add_special_tokens=False):
            if not matcher.consume_token(token):
                break
        return matcher

    def accepts(self, grammar: str, text: str) -> bool:
        """The whole text is allowed and completes the grammar."""
        matcher = self.feed(grammar, text)
        return not matcher.is_error() and matcher.is_accepting()

    def refuses(self, grammar: str, text: str) -> bool:
        return bool(self.feed(grammar, text).is_error())


@pytest.fixture(scope="module")
def hermes(hermes_model_dir: Path) -> Model:
    tokenizer = load_tokenizer(hermes_model_dir)
    return Model(tokenizer, Grammars(tokenizer))


@pytest.fixture(scope="module")
def coder(coder_model_dir: Path) -> Model:
    tokenizer = load_tokenizer(coder_model_dir)
    return Model(tokenizer, Grammars(tokenizer))


def hermes_call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# ---- response_format ---------------------------------------------------------------------------


SCHEMA_FORMAT = ResponseFormat(OutputFormat.JSON_SCHEMA, WEATHER_SCHEMA, "weather", strict=True)


@pytest.mark.parametrize(
    "instance",
    [
        {"city": "Paris", "days": 3},
        {"city": 'say "hi" {x}', "days": -1, "tags": ["a", "b c"]},
        {"city": "", "days": 0, "tags": []},
    ],
)
def test_schema_accepts_an_instance_as_json_dumps_writes_it(
    hermes: Model, instance: dict[str, Any]
) -> None:
    grammar = response_grammar(SCHEMA_FORMAT)
    assert grammar is not None
    matcher = hermes.feed(grammar, json.dumps(instance))
    assert not matcher.is_error()
    assert matcher.is_accepting()
    assert matcher.is_stopped()  # nothing may follow the closing brace


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(json.dumps({"city": "Paris", "days": "3"}), id="wrong-type"),
        pytest.param(json.dumps({"city": "Paris"}), id="missing-required"),
        pytest.param(json.dumps({"city": "Paris", "days": 3, "x": 1}), id="extra-property"),
        pytest.param(json.dumps({"city": "P", "days": 3}, separators=(",", ":")), id="compact"),
        pytest.param('{"city": "Paris",  "days": 3}', id="free-whitespace"),
        pytest.param('["Paris", 3]', id="array"),
        pytest.param(json.dumps({"city": "Paris", "days": 3}) + "\n", id="text-after"),
    ],
)
def test_schema_refuses_other_texts(hermes: Model, text: str) -> None:
    grammar = response_grammar(SCHEMA_FORMAT)
    assert grammar is not None
    assert hermes.refuses(grammar, text)


def test_an_unfinished_instance_is_not_accepting(hermes: Model) -> None:
    grammar = response_grammar(SCHEMA_FORMAT)
    assert grammar is not None
    matcher = hermes.feed(grammar, '{"city": "Paris", "days": 3')
    assert not matcher.is_error()
    assert not matcher.is_accepting() and not matcher.is_stopped()


def test_json_object_takes_any_object(hermes: Model) -> None:
    grammar = response_grammar(ResponseFormat(OutputFormat.JSON_OBJECT))
    assert grammar is not None
    text = json.dumps({"a": [1, 2.5, None, True], "b": {"c": "d"}, "e": ""})
    matcher = hermes.feed(grammar, text)
    assert matcher.is_accepting() and matcher.is_stopped()
    assert hermes.accepts(grammar, "{}")
    assert hermes.refuses(grammar, "[1]")
    assert hermes.refuses(grammar, '"text"')
    assert hermes.refuses(grammar, "Sure! {")


def test_text_is_not_constrained() -> None:
    assert response_grammar(ResponseFormat(OutputFormat.TEXT)) is None


def test_a_json_schema_format_without_a_schema_is_an_error() -> None:
    no_schema = ResponseFormat(OutputFormat.JSON_SCHEMA, None, param="text.format")
    with pytest.raises(GrammarError) as caught:
        response_grammar(no_schema)
    assert caught.value.param == "text.format"


def test_a_schema_that_is_not_json_is_an_error() -> None:
    with pytest.raises(GrammarError) as caught:
        json_grammar({"type": "object", "default": {1, 2}}, "response_format", strict=False)
    assert caught.value.param == "response_format"


# Keywords llguidance does not implement: a warning when lenient, an error when strict.
UNIQUE: dict[str, Any] = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
UNKNOWN_FORMAT: dict[str, Any] = {"type": "string", "format": "made-up-format"}
UNIMPLEMENTED = [
    pytest.param(UNIQUE, id="unique"),
    pytest.param(UNKNOWN_FORMAT, id="unknown-format"),
]


@pytest.mark.parametrize("schema", UNIMPLEMENTED)
def test_a_lenient_schema_ignores_what_llguidance_lacks(
    hermes: Model, schema: dict[str, Any]
) -> None:
    grammar = json_grammar(schema, "response_format", strict=False)
    matcher = hermes.grammars.matcher(grammar)
    assert not matcher.is_error()


def test_a_lenient_schema_is_enforced_without_the_ignored_keyword(hermes: Model) -> None:
    grammar = json_grammar(UNIQUE, "response_format", strict=False)
    assert hermes.accepts(grammar, "[1, 1]")  # uniqueItems was not enforced
    assert hermes.refuses(grammar, '["a"]')  # the items' type was


@pytest.mark.parametrize("schema", UNIMPLEMENTED)
def test_a_strict_schema_llguidance_cannot_enforce_does_not_compile(
    hermes: Model, schema: dict[str, Any]
) -> None:
    # found when the grammar is compiled (the preprocessor's 400 names the request's field)
    grammar = json_grammar(schema, "response_format", strict=True)
    with pytest.raises(ValueError, match=r"Unimplemented|Unknown format"):
        hermes.grammars.matcher(grammar)


def test_a_reference_to_nowhere_does_not_compile(hermes: Model) -> None:
    for strict in (True, False):
        grammar = json_grammar({"$ref": "#/$defs/nothing"}, "response_format", strict)
        with pytest.raises(ValueError, match="does not exist"):
            hermes.grammars.matcher(grammar)


def test_a_reference_loop_fails_at_compile_not_at_the_first_token(hermes: Model) -> None:
    """llguidance finds it at the first mask: checked there at once, a 400, not an answer
    of nothing."""
    loop = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
    for schema in ({**loop, "$ref": "#/$defs/a"}, {"$ref": "#"}):
        grammar = json_grammar(schema, "response_format", True)
        with pytest.raises(ValueError):
            hermes.grammars.matcher(grammar)


# ---- the compiled grammars ---------------------------------------------------------------------


def test_matchers_of_one_grammar_are_independent_copies(hermes: Model) -> None:
    grammar = response_grammar(SCHEMA_FORMAT)
    assert grammar is not None
    first = hermes.feed(grammar, '{"city": "Paris"')
    second = hermes.grammars.matcher(grammar)
    assert first is not second
    assert hermes.accepts(grammar, json.dumps({"city": "Lyon", "days": 1}))
    assert not first.is_error() and not first.is_accepting()
    assert not second.is_error() and not second.is_accepting()


def test_compiled_grammars_are_bounded(hermes: Model) -> None:
    small = Grammars(hermes.tokenizer, capacity=2)
    texts = [json_grammar({"const": i}, "response_format", True) for i in range(3)]
    for text in texts:
        small.matcher(text)
    assert list(small._compiled) == texts[1:]
    small.matcher(texts[1])  # used last: kept over texts[2]
    small.matcher(texts[0])
    assert list(small._compiled) == [texts[1], texts[0]]


def test_a_grammar_that_does_not_compile_is_a_value_error(hermes: Model) -> None:
    with pytest.raises(ValueError):
        hermes.grammars.matcher("start: undefined_rule\n")


def test_words_cover_the_vocabulary(hermes: Model) -> None:
    words = hermes.grammars.words
    assert words * 32 >= len(hermes.tokenizer) > (words - 1) * 32


def test_a_marker_that_is_one_added_token_is_that_token(
    hermes: Model,
) -> None:
    # llguidance takes added tokens as special: reachable by id only, not by their text
    token = hermes.tokenizer.convert_tokens_to_ids("<tool_call>")
    assert hermes.grammars.literal("<tool_call>") == f"<[{token}]>"
    assert hermes.grammars.literal("[TOOL_CALLS]") == json.dumps("[TOOL_CALLS]")


# ---- forced tool calls -------------------------------------------------------------------------


WEATHER_CALL = hermes_call("get_weather", {"city": "Paris", "days": 3})
TIME_CALL = hermes_call("get_time", {"tz": "UTC"})


def forced(hermes: Model, parser: str, choice: ToolChoice = REQUIRED) -> str:
    grammar = tool_grammar(TOOLS, choice, tool_format(parser), hermes.grammars.literal)
    assert grammar is not None
    return grammar


def test_json_tools_call_is_accepted(hermes: Model) -> None:
    grammar = forced(hermes, "json_tools")
    matcher = hermes.feed(grammar, WEATHER_CALL)
    assert not matcher.is_error() and matcher.is_accepting()
    assert not matcher.is_stopped()  # parallel: another call may follow
    assert hermes.accepts(grammar, TIME_CALL)


@pytest.mark.parametrize("separator", ["\n", ""])
def test_json_tools_parallel_calls(hermes: Model, separator: str) -> None:
    grammar = forced(hermes, "json_tools")
    assert hermes.accepts(grammar, WEATHER_CALL + separator + TIME_CALL + separator + TIME_CALL)


def test_json_tools_single_call_stops_after_one(hermes: Model) -> None:
    grammar = forced(hermes, "json_tools", ToolChoice(ToolChoiceMode.REQUIRED, parallel=False))
    matcher = hermes.feed(grammar, WEATHER_CALL)
    assert matcher.is_accepting() and matcher.is_stopped()
    assert hermes.refuses(grammar, WEATHER_CALL + "\n" + TIME_CALL)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("Sure, " + WEATHER_CALL, id="text-first"),
        pytest.param(hermes_call("get_weather", {"city": "Paris"}), id="missing-required"),
        pytest.param(hermes_call("get_weather", {"city": "Paris", "days": "3"}), id="wrong-type"),
        pytest.param(hermes_call("get_news", {}), id="unknown-tool"),
        pytest.param(
            '<tool_call>\n{"arguments": {"tz": "UTC"}, "name": "get_time"}\n</tool_call>',
            id="arguments-first",
        ),
        pytest.param(
            '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>',
            id="no-newlines",
        ),
    ],
)
def test_json_tools_refuses_other_calls(hermes: Model, text: str) -> None:
    assert hermes.refuses(forced(hermes, "json_tools"), text)


def test_a_named_choice_allows_that_tool_only(hermes: Model) -> None:
    grammar = forced(hermes, "json_tools", ToolChoice(ToolChoiceMode.REQUIRED, name="get_time"))
    assert hermes.accepts(grammar, TIME_CALL)
    assert hermes.refuses(grammar, WEATHER_CALL)


def test_a_lenient_tool_takes_any_arguments_object_without_a_schema(hermes: Model) -> None:
    loose = Tool("anything")
    grammar = tool_grammar([loose], REQUIRED, tool_format("json_tools"), hermes.grammars.literal)
    assert grammar is not None
    assert hermes.accepts(grammar, hermes_call("anything", {"x": [1, {"y": None}]}))
    assert hermes.refuses(grammar, hermes_call("anything", [1]))  # type: ignore[arg-type]


def test_mistral_calls_are_a_json_list(hermes: Model) -> None:
    grammar = forced(hermes, "mistral")
    calls = [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
        {"name": "get_time", "arguments": {"tz": "UTC"}},
    ]
    assert hermes.accepts(grammar, "[TOOL_CALLS]" + json.dumps(calls))
    one = forced(hermes, "mistral", ToolChoice(ToolChoiceMode.REQUIRED, parallel=False))
    matcher = hermes.feed(one, "[TOOL_CALLS]" + json.dumps(calls[:1]))
    assert matcher.is_accepting() and matcher.is_stopped()
    assert hermes.refuses(one, "[TOOL_CALLS]" + json.dumps(calls))
    assert hermes.refuses(grammar, "[TOOL_CALLS][]")


# qwen3_coder: one call in Qwen3-Coder's XML, each parameter on lines of its own
def coder_call(name: str, parameters: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


COUNT = Tool(
    "count",
    parameters={
        "type": "object",
        "properties": {"n": {"type": "integer"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["n"],
    },
)
SHORT = Tool(
    "label",
    parameters={
        "type": "object",
        "properties": {"text": {"type": "string", "maxLength": 12}},
        "required": ["text"],
    },
)


def coder_grammar(coder: Model, tools: list[Tool], choice: ToolChoice = REQUIRED) -> str:
    grammar = tool_grammar(tools, choice, tool_format("qwen3_coder"), coder.grammars.literal)
    assert grammar is not None
    return grammar


def test_qwen3_coder_integer_and_enum_parameters(coder: Model) -> None:
    grammar = coder_grammar(coder, [COUNT])
    assert coder.accepts(grammar, coder_call("count", {"n": "3"}))
    assert coder.accepts(grammar, coder_call("count", {"n": "-12", "unit": "f"}))
    assert coder.refuses(grammar, coder_call("count", {"n": "three"}))
    assert coder.refuses(grammar, coder_call("count", {"n": "3", "unit": "k"}))
    assert coder.refuses(grammar, coder_call("count", {"unit": "c"}))  # n required


def test_qwen3_coder_single_and_parallel(coder: Model) -> None:
    one = coder_call("count", {"n": "1"})
    single = coder_grammar(coder, [COUNT], ToolChoice(ToolChoiceMode.REQUIRED, parallel=False))
    matcher = coder.feed(single, one)
    assert matcher.is_accepting() and matcher.is_stopped()
    assert coder.refuses(single, one + "\n" + one)
    parallel = coder_grammar(coder, [COUNT])
    assert coder.accepts(parallel, one + "\n" + one)


def test_qwen3_coder_string_with_max_length(coder: Model) -> None:
    grammar = coder_grammar(coder, [SHORT])
    assert coder.accepts(grammar, coder_call("label", {"text": "New York"}))
    assert coder.refuses(grammar, coder_call("label", {"text": "far too long a label"}))


def test_qwen3_coder_named_choice(coder: Model) -> None:
    grammar = coder_grammar(
        coder, [COUNT, SHORT], ToolChoice(ToolChoiceMode.REQUIRED, name="count")
    )
    assert coder.accepts(grammar, coder_call("count", {"n": "2"}))
    assert coder.refuses(grammar, coder_call("label", {"text": "x"}))


def test_qwen3_coder_string_and_integer_parameters(coder: Model) -> None:
    grammar = coder_grammar(coder, TOOLS)
    text = coder_call("get_weather", {"city": "New York", "days": "3"})
    assert coder.accepts(grammar, text)


# ---- choices that are not forced ---------------------------------------------------------------


def test_none_is_not_constrained_nor_auto_without_a_strict_tool() -> None:
    none = ToolChoice(ToolChoiceMode.NONE)
    assert tool_grammar(TOOLS, none, tool_format("json_tools"), answer=SCHEMA_FORMAT) is None
    assert tool_grammar(TOOLS, none, None) is None
    auto = ToolChoice(ToolChoiceMode.AUTO)
    assert tool_grammar([TIME], auto, tool_format("json_tools")) is None
    assert tool_grammar([TIME], auto, None) is None  # nothing to hold: no format needed


def test_a_named_tool_that_is_not_in_tools_is_an_error() -> None:
    choice = ToolChoice(ToolChoiceMode.REQUIRED, name="get_news")
    with pytest.raises(GrammarError, match="get_news") as caught:
        tool_grammar(TOOLS, choice, tool_format("json_tools"))
    assert caught.value.param == "tool_choice"


@pytest.mark.parametrize("parser", ["pythonic", "glm47", "kimi_k2", "gemma4"])
def test_a_format_that_cannot_be_forced_is_an_error(parser: str) -> None:
    with pytest.raises(GrammarError, match="tool_choice auto") as caught:
        tool_grammar(TOOLS, REQUIRED, tool_format(parser))
    assert caught.value.param == "tool_choice"


def test_a_model_without_a_call_format_cannot_be_forced() -> None:
    with pytest.raises(GrammarError) as caught:
        tool_grammar(TOOLS, REQUIRED, None)
    assert caught.value.param == "tool_choice"


# ---- a tool schema's root definitions (Pydantic's `$defs`) in a forced call ----------------

CONVERT = Tool(
    "convert",
    parameters={
        "type": "object",
        "$defs": {
            "Temp": {
                "type": "object",
                "properties": {"unit": {"enum": ["c", "f"]}},
                "required": ["unit"],
            }
        },
        "properties": {"t": {"$ref": "#/$defs/Temp"}},
        "required": ["t"],
    },
    strict=True,
)


def test_a_tools_definitions_hold_in_its_forced_call(hermes: Model, coder: Model) -> None:
    """The call wraps the parameters: their `#/$defs/...` must still point somewhere."""
    grammar = tool_grammar([CONVERT], REQUIRED, tool_format("json_tools"), hermes.grammars.literal)
    assert grammar is not None
    assert hermes.accepts(grammar, hermes_call("convert", {"t": {"unit": "c"}}))
    assert hermes.refuses(grammar, hermes_call("convert", {"t": {"unit": "k"}}))
    xml = coder_grammar(coder, [CONVERT])
    assert coder.accepts(xml, coder_call("convert", {"t": json.dumps({"unit": "f"})}))


def test_definitions_two_tools_give_one_name_are_an_error_or_one() -> None:
    again = Tool("again", parameters={**(CONVERT.parameters or {}), "properties": {}})
    assert tool_grammar([CONVERT, again], REQUIRED, tool_format("json_tools"))
    other = Tool("other", parameters={"type": "object", "$defs": {"Temp": {"type": "string"}}})
    with pytest.raises(GrammarError, match="in two ways") as info:
        tool_grammar([CONVERT, other], REQUIRED, tool_format("json_tools"))
    assert info.value.param == "tools"


def test_an_xml_tool_schema_of_the_wrong_shape_is_an_error() -> None:
    bad = Tool("bad", parameters={"type": "object", "properties": [1]})
    with pytest.raises(GrammarError, match="must be an object") as info:
        tool_grammar([bad], REQUIRED, tool_format("qwen3_coder"))
    assert info.value.param == "tools"
