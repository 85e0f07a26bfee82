"""worker/preprocess.py over a real tiny model: templating, tokenizing and the checks a
request meets before the engine (context, max_tokens, token ids, template variables, fields
a text worker does not serve)."""

from __future__ import annotations

import contextlib
from collections import UserDict
from pathlib import Path

import msgspec
import pytest

from shared.config import EngineOptions
from shared.protocol import Add
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    ImagePart,
    Message,
    OutputFormat,
    Reasoning,
    RequestKind,
    ResponseFormat,
    SamplingParams,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)
from tests.engine_fixtures import Loaded, drive, load, token_ids
from worker.modelgen import IM_START_ID, TinyModelSpec, build_tiny_model
from worker.preprocess import (
    PreparedRequest,
    PreprocessError,
    Preprocessor,
    _template_ids,
    capabilities,
)
from worker.structured.guide import Guide


def test_preprocess_allows_zero_max_tokens_with_echo(preprocess: Preprocessor) -> None:
    frame = add_frame(
        RequestKind.COMPLETION, CanonicalRequest(prompt="Hi"), max_tokens=0, echo=True
    )
    assert preprocess(frame).max_tokens == 0


# ---- Preprocessor -------------------------------------------------------------------------


def add_frame(kind: RequestKind, request: CanonicalRequest, **sampling: object) -> Add:
    return Add("r1", kind, request, SamplingParams(**sampling))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def preprocess(chat: Loaded) -> Preprocessor:
    return Preprocessor(chat.tokenizer, EngineOptions(default_max_tokens=8), max_context=64)


def test_preprocess_chat(chat: Loaded, preprocess: Preprocessor) -> None:
    request = CanonicalRequest(messages=[Message("system", "Be brief."), Message("user", "Hi")])
    result = preprocess(add_frame(RequestKind.CHAT, request, max_tokens=5))
    expected = chat.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
    )
    assert result.prompt == list(expected)
    assert result.prompt[0] == IM_START_ID
    assert result.max_tokens == 5
    assert result.request_id == "r1"


def test_preprocess_completion_and_defaults(chat: Loaded, preprocess: Preprocessor) -> None:
    result = preprocess(add_frame(RequestKind.COMPLETION, CanonicalRequest(prompt="Hello there")))
    assert result.prompt == chat.tokenizer.encode("Hello there")
    assert result.max_tokens == 8  # default_max_tokens
    ids = CanonicalRequest(prompt_token_ids=[5, 6, 7])
    no_default = Preprocessor(chat.tokenizer, EngineOptions(), max_context=64)
    result = no_default(add_frame(RequestKind.COMPLETION, ids))
    assert result.prompt == [5, 6, 7]
    assert result.max_tokens == 61  # all the room left


class Ids(UserDict[str, list[int]]):
    """As transformers' BatchEncoding: a UserDict whose ids are also an attribute."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__({"input_ids": ids})
        self.input_ids = ids


def preprocess_error(preprocess: Preprocessor, frame: Add) -> PreprocessError:
    with pytest.raises(PreprocessError) as info:
        preprocess(frame)
    return info.value


def test_prompt_too_long(preprocess: Preprocessor) -> None:
    # no length asked for (max_tokens None, as Codex sends): the prompt alone is told
    frame = add_frame(RequestKind.COMPLETION, CanonicalRequest(prompt_token_ids=[5] * 70))
    error = preprocess_error(preprocess, frame).error
    assert error.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert "However, your messages resulted in 70 tokens." in error.message
    assert error.context == [64, 70, 0]  # for protocols that say it their own way
    asked = preprocess_error(
        preprocess, add_frame(RequestKind.COMPLETION, frame.request, max_tokens=2)
    )
    assert "(70 in the prompt, 2 for the completion)" in asked.error.message


def test_max_tokens_beyond_room(preprocess: Preprocessor) -> None:
    request = CanonicalRequest(prompt_token_ids=[5] * 60)
    assert preprocess(add_frame(RequestKind.COMPLETION, request, max_tokens=4)).max_tokens == 4
    frame = add_frame(RequestKind.COMPLETION, request, max_tokens=5)
    error = preprocess_error(preprocess, frame).error
    assert error.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert "65 tokens" in error.message


@pytest.mark.parametrize(
    "request_",
    [
        CanonicalRequest(prompt=""),
        CanonicalRequest(prompt_token_ids=[]),
        CanonicalRequest(messages=[], add_generation_prompt=False),
    ],
)
def test_empty_prompt(preprocess: Preprocessor, request_: CanonicalRequest) -> None:
    kind = (
        RequestKind.CHAT
        if request_.prompt is None and request_.prompt_token_ids is None
        else (RequestKind.COMPLETION)
    )
    error = preprocess_error(preprocess, add_frame(kind, request_)).error
    assert error.code is ErrorCode.INVALID_REQUEST
    assert "empty" in error.message


@pytest.mark.parametrize("bad", [512, -1, 10**9])
def test_token_id_outside_the_vocabulary(preprocess: Preprocessor, bad: int) -> None:
    frame = add_frame(RequestKind.COMPLETION, CanonicalRequest(prompt_token_ids=[5, bad, 6]))
    error = preprocess_error(preprocess, frame).error
    assert error.code is ErrorCode.INVALID_REQUEST
    assert error.param == "prompt"
    assert str(bad) in error.message


def test_min_tokens_above_max_tokens(preprocess: Preprocessor) -> None:
    frame = add_frame(
        RequestKind.COMPLETION, CanonicalRequest(prompt="Hi"), max_tokens=3, min_tokens=4
    )
    error = preprocess_error(preprocess, frame).error
    assert error.code is ErrorCode.INVALID_REQUEST
    assert error.param == "min_tokens"


def test_zero_max_tokens_is_rejected(preprocess: Preprocessor) -> None:
    frame = add_frame(RequestKind.COMPLETION, CanonicalRequest(prompt="Hi"), max_tokens=0)
    assert preprocess_error(preprocess, frame).error.code is ErrorCode.INVALID_REQUEST


USER_HI = [Message("user", "Hi")]


def test_preprocess_chat_template_kwargs(chat: Loaded, preprocess: Preprocessor) -> None:
    """The tiny models' template honours enable_thinking (off when absent or false)."""

    def prompt(**kwargs: str | bool | int | float) -> list[int]:
        request = CanonicalRequest(messages=USER_HI, chat_template_kwargs=kwargs)
        return preprocess(add_frame(RequestKind.CHAT, request, max_tokens=1)).prompt

    plain = prompt()
    thinking = prompt(enable_thinking=True)
    assert thinking[: len(plain)] == plain
    assert chat.tokenizer.decode(thinking[len(plain) :]) == "<think>\n"
    assert prompt(enable_thinking=False) == plain
    # the tokenize control call templates the same way
    request = CanonicalRequest(messages=USER_HI, chat_template_kwargs={"enable_thinking": True})
    call = {"kind": "chat", "request": msgspec.to_builtins(request), "with_text": True}
    result = preprocess.tokenize_call(call)
    assert result["tokens"] == thinking and result["count"] == len(thinking)
    assert "".join(result["token_strs"]).endswith("<|im_start|>assistant\n<think>\n")
    assert result["max_context"] == 64


@pytest.fixture(scope="module")
def no_template(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    spec = TinyModelSpec(hidden_size=32, num_layers=1, vocab_size=300, chat_template=False)
    return load(build_tiny_model(tmp_path_factory.mktemp("base") / "base", spec))


def test_model_without_chat_template(no_template: Loaded) -> None:
    assert capabilities(no_template.tokenizer) == [
        "completion",
        "logprobs",
        "echo",
        "tokenize",
        "structured_output",
    ]  # no tools or reasoning without a template
    preprocess = Preprocessor(no_template.tokenizer, EngineOptions(), max_context=64)
    chat_frame = add_frame(RequestKind.CHAT, CanonicalRequest(messages=USER_HI), max_tokens=1)
    error = preprocess_error(preprocess, chat_frame).error
    assert error.code is ErrorCode.INVALID_REQUEST
    assert error.param == "messages"
    assert "chat template" in error.message
    prompt = CanonicalRequest(prompt="Once upon a time")
    ready = preprocess(add_frame(RequestKind.COMPLETION, prompt, max_tokens=3, temperature=0.0))
    out = drive(no_template.engine(), [ready])["r1"]
    assert 1 <= len(token_ids(out)) <= 3


def test_a_text_worker_refuses_images_and_audio(preprocess: Preprocessor) -> None:
    """The gateway refuses these first; a frame that carries one anyway is a 400 naming it,
    never a prompt with the part silently left out."""
    message = Message("user", "look", parts=[ImagePart(b"\x89PNG", "image/png")])
    request = CanonicalRequest(messages=[Message("user", "Hi"), message])
    error = preprocess_error(preprocess, add_frame(RequestKind.CHAT, request)).error
    assert error.code is ErrorCode.INVALID_REQUEST
    assert error.param == "messages[1].parts"


# ---- tools, thinking, structured output ---------------------------------------------------

WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


@pytest.fixture(scope="module")
def hermes(hermes_model_dir: Path) -> Loaded:
    return load(hermes_model_dir)


def prompt_text(loaded: Loaded, request: CanonicalRequest, **options: object) -> str:
    preprocess = Preprocessor(loaded.tokenizer, EngineOptions(**options), max_context=4096)  # type: ignore[arg-type]
    return str(loaded.tokenizer.decode(preprocess(add_frame(RequestKind.CHAT, request)).prompt))


def test_history_tool_calls_results_and_reasoning_go_through_the_template(
    hermes: Loaded,
) -> None:
    call = ToolCall("c1", "get_weather", '{"city": "Oslo"}')
    request = CanonicalRequest(
        messages=[
            Message("user", "Weather in Oslo?"),
            Message("assistant", "", tool_calls=[call], reasoning="Look it up."),
            Message("tool", "12C and rain", tool_call_id="c1"),
        ],
        tools=[WEATHER],
    )
    text = prompt_text(hermes, request)
    assert '"name": "get_weather"' in text  # the tool, rendered by the template
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert "<tool_response>\n12C and rain\n</tool_response>" in text
    assert "<think>\nLook it up.\n</think>" in text


def test_thinking_switch_and_tool_choice_none(hermes: Loaded) -> None:
    user = [Message("user", "Hi")]
    on = prompt_text(hermes, CanonicalRequest(messages=user, reasoning=Reasoning(enabled=True)))
    off = prompt_text(hermes, CanonicalRequest(messages=user, reasoning=Reasoning(enabled=False)))
    assert on.endswith("<think>\n") and off.endswith("</think>\n\n")
    none = ToolChoice(ToolChoiceMode.NONE)
    quiet = prompt_text(hermes, CanonicalRequest(messages=user, tools=[WEATHER], tool_choice=none))
    assert "get_weather" not in quiet  # tool_choice none: the tools stay out of the prompt


def test_guides_and_parsers_follow_the_request(hermes: Loaded) -> None:
    preprocess = Preprocessor(hermes.tokenizer, EngineOptions(), max_context=4096)
    user = [Message("user", "Hi")]
    plain = preprocess(add_frame(RequestKind.CHAT, CanonicalRequest(messages=user)))
    assert plain.guide is None and plain.parser is not None  # thinking is still parsed
    forced = CanonicalRequest(
        messages=user, tools=[WEATHER], tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)
    )
    prepared = preprocess(add_frame(RequestKind.CHAT, forced))
    assert prepared.guide is not None and prepared.guide.compiling is not None
    assert compiled(prepared.guide).matcher is not None
    assert prepared.guide.thinking  # the prompt opened a think block: the grammar waits
    budget = CanonicalRequest(messages=user, reasoning=Reasoning(enabled=True, budget_tokens=3))
    guide = preprocess(add_frame(RequestKind.CHAT, budget)).guide
    assert guide is not None and guide.matcher is None and guide.budget == 3
    fmt = ResponseFormat(OutputFormat.JSON_OBJECT)
    completion = CanonicalRequest(prompt="Hi", response_format=fmt)
    assert preprocess(add_frame(RequestKind.COMPLETION, completion)).guide is not None


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (CanonicalRequest(messages=USER_HI, tools=[WEATHER]), "tools"),
        (CanonicalRequest(messages=USER_HI, reasoning=Reasoning(enabled=True)), "reasoning"),
        (
            CanonicalRequest(messages=USER_HI, reasoning=Reasoning(effort="high")),
            "reasoning_effort",
        ),
    ],
)
def test_what_the_model_cannot_do_is_a_400_naming_it(
    preprocess: Preprocessor, request_: CanonicalRequest, param: str
) -> None:
    error = preprocess_error(preprocess, add_frame(RequestKind.CHAT, request_)).error
    assert error.code is ErrorCode.INVALID_REQUEST
    assert error.param == param, error.message


def compiled(guide: Guide) -> Guide:
    """The guide once its grammar's compile on the grammar thread is done."""
    if guide.compiling is not None:
        with contextlib.suppress(ValueError):
            guide.compiling.result(timeout=60)
    assert guide.ready()
    return guide


def test_a_grammar_that_cannot_compile_is_a_400_here_or_once_compiled(hermes: Loaded) -> None:
    # found by its compile (a `$ref` to nothing): on the grammar thread the request waits for,
    # and the engine answers the 400; where the compile is known, or done here, at once
    param = "response_format.json_schema.schema"
    schema = {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}
    fmt = ResponseFormat(OutputFormat.JSON_SCHEMA, schema, param=param, strict=True)
    frame = add_frame(RequestKind.CHAT, CanonicalRequest(messages=USER_HI, response_format=fmt))
    waiting = Preprocessor(hermes.tokenizer, EngineOptions(), max_context=4096)
    guide = waiting(frame).guide
    assert guide is not None and guide.compiling is not None and not guide.stopped
    assert compiled(guide).matcher is None and guide.param == param
    assert guide.compile_error is not None and "nowhere" in guide.compile_error
    again = preprocess_error(waiting, frame).error  # the same text fails the same way
    assert again.code is ErrorCode.INVALID_REQUEST and again.param == param
    zero = add_frame(RequestKind.CHAT, frame.request, max_tokens=0, echo=True)
    fresh = Preprocessor(hermes.tokenizer, EngineOptions(), max_context=4096)
    assert preprocess_error(fresh, zero).error.param == param  # answered when added: here
    here = Preprocessor(hermes.tokenizer, EngineOptions(), max_context=4096)
    here.off_path = False  # a sharded group's ranks
    error = preprocess_error(here, frame).error
    assert error.param == param and "cannot be compiled" in error.message


def test_forced_calls_name_a_tool_of_the_request(hermes: Loaded) -> None:
    preprocess = Preprocessor(hermes.tokenizer, EngineOptions(), max_context=4096)
    named = ToolChoice(ToolChoiceMode.REQUIRED, "nope")
    request = CanonicalRequest(messages=USER_HI, tools=[WEATHER], tool_choice=named)
    error = preprocess_error(preprocess, add_frame(RequestKind.CHAT, request)).error
    assert error.param == "tool_choice" and "nope" in error.message
    completion = CanonicalRequest(prompt="Hi", tools=[WEATHER])
    error = preprocess_error(preprocess, add_frame(RequestKind.COMPLETION, completion)).error
    assert error.param == "tools"


def test_a_tool_schema_of_the_wrong_shape_is_a_400_not_a_500(coder_model_dir: Path) -> None:
    coder = load(coder_model_dir)  # Qwen3-Coder's XML calls: each parameter its own grammar
    preprocess = Preprocessor(coder.tokenizer, EngineOptions(), max_context=4096)
    enum = {"type": "string", "enum": 5}  # not a list
    odd = Tool("odd", parameters={"type": "object", "properties": {"u": enum}})
    request = CanonicalRequest(
        messages=USER_HI, tools=[odd], tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)
    )
    error = preprocess_error(preprocess, add_frame(RequestKind.CHAT, request)).error
    assert error.code is ErrorCode.INVALID_REQUEST, error.message


def test_a_response_format_beside_callable_tools_is_that_json_or_calls(hermes: Loaded) -> None:
    """Under auto the output is the format's JSON or the model's calls: one grammar over
    both (tests/test_grammars_auto.py), its compile errors naming the format. Under none
    the format alone."""
    preprocess = Preprocessor(hermes.tokenizer, EngineOptions(), max_context=4096)
    fmt = ResponseFormat(OutputFormat.JSON_OBJECT, param="response_format")
    request = CanonicalRequest(messages=USER_HI, tools=[WEATHER], response_format=fmt)
    guide = preprocess(add_frame(RequestKind.CHAT, request)).guide
    assert guide is not None and guide.param == "response_format"
    strict = msgspec.structs.replace(WEATHER, strict=True)
    both = msgspec.structs.replace(request, tools=[strict])
    guide = preprocess(add_frame(RequestKind.CHAT, both)).guide
    assert guide is not None and guide.param == "response_format"  # (a strict tool's too)
    (marker,) = hermes.tokenizer.encode("<tool_call>", add_special_tokens=False)
    assert guide.call_marker == marker  # no call starts inside a think block
    none = ToolChoice(ToolChoiceMode.NONE)
    constrained = msgspec.structs.replace(request, tool_choice=none)
    guide = preprocess(add_frame(RequestKind.CHAT, constrained)).guide
    assert guide is not None and guide.param == "response_format"
    assert guide.call_marker is None  # no calls in this grammar


def test_a_strict_tool_under_auto_gets_a_guide_and_a_lenient_one_none(hermes: Loaded) -> None:
    preprocess = Preprocessor(hermes.tokenizer, EngineOptions(), max_context=4096)
    lenient = CanonicalRequest(messages=USER_HI, tools=[WEATHER])
    assert preprocess(add_frame(RequestKind.CHAT, lenient)).guide is None
    strict = msgspec.structs.replace(WEATHER, strict=True)
    request = msgspec.structs.replace(lenient, tools=[strict, WEATHER])
    guide = preprocess(add_frame(RequestKind.CHAT, request)).guide
    assert guide is not None and guide.param == "tools"


def test_a_model_with_nothing_to_parse_gets_no_parser(preprocess: Preprocessor) -> None:
    """No think block, no tools: the output is all answer, parsed by nothing per token."""
    prepared = preprocess(add_frame(RequestKind.CHAT, CanonicalRequest(messages=USER_HI)))
    assert prepared.parser is None and prepared.guide is None


@pytest.mark.parametrize(
    "made",
    [[1, 2], (1, 2), {"input_ids": [1, 2]}, UserDict({"input_ids": [1, 2]}), Ids([1, 2])],
)
def test_a_templates_ids_are_taken_from_any_shape_transformers_returns(made: object) -> None:
    assert _template_ids(made) == [1, 2]


@pytest.mark.parametrize("made", ["<|im_start|>hi", None, 3, {"text": "hi"}, ["a", "b"]])
def test_a_template_that_made_no_ids_is_a_400_naming_chat_template_kwargs(made: object) -> None:
    with pytest.raises(PreprocessError) as info:
        _template_ids(made)
    assert info.value.error.param == "chat_template_kwargs"


def test_advisory_thinking_settings_leave_out_what_the_model_cannot_do(
    preprocess: Preprocessor, hermes: Loaded
) -> None:
    # Anthropic's adaptive thinking and effort are guidance (Claude Code sends them with
    # every request): a model without thinking answers plainly, a thinking template that
    # takes no effort level thinks without one; asked for as such, each is a 400
    advisory = Reasoning(effort="high", advisory=True)
    request = CanonicalRequest(messages=USER_HI, reasoning=advisory)
    plain = preprocess(add_frame(RequestKind.CHAT, request))  # "chat": no thinking
    assert plain.guide is None
    thinker = Preprocessor(hermes.tokenizer, EngineOptions(), max_context=4096)
    thinks = thinker(add_frame(RequestKind.CHAT, request))
    assert thinks.parser is not None and thinks.parser.in_reasoning  # its default: on
    asked = CanonicalRequest(messages=USER_HI, reasoning=Reasoning(effort="high"))
    assert preprocess_error(thinker, add_frame(RequestKind.CHAT, asked)).error.param == (
        "reasoning_effort"
    )


def test_a_guided_output_opens_a_think_block_only_where_the_prompt_leaves_it(
    hermes: Loaded,
) -> None:
    """A prompt that leaves thinking to the model (Qwen3's template with thinking on; here
    the rendered turn without its opened block): the first token may open the block. A turn
    whose template closed an empty block (thinking off) may not; raw completions never."""
    preprocess = Preprocessor(hermes.tokenizer, EngineOptions(), max_context=4096)
    fmt = ResponseFormat(OutputFormat.JSON_OBJECT, param="response_format")
    (think,) = hermes.tokenizer.encode("<think>", add_special_tokens=False)
    turn = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    prepared = PreparedRequest("r1", hermes.tokenizer.encode(turn), 16, SamplingParams())
    preprocess._shape_output(prepared, CanonicalRequest(messages=USER_HI, response_format=fmt))
    assert prepared.guide is not None and prepared.guide.opening == think
    off = {"enable_thinking": False}
    chat = CanonicalRequest(messages=USER_HI, response_format=fmt, chat_template_kwargs=off)
    guide = preprocess(add_frame(RequestKind.CHAT, chat)).guide
    assert guide is not None and guide.opening is None
    raw = CanonicalRequest(prompt="Answer:", response_format=fmt)
    guide = preprocess(add_frame(RequestKind.COMPLETION, raw)).guide
    assert guide is not None and guide.opening is None


def test_a_continuation_starts_where_the_prompt_left_its_output(hermes: Loaded) -> None:
    """Its resumed tokens are replayed through the guide as output: where the output starts
    (inside the think block the template opened) is read from the prompt before them."""
    preprocess = Preprocessor(hermes.tokenizer, EngineOptions(), max_context=4096)
    strict = msgspec.structs.replace(WEATHER, strict=True)
    thinking = {"enable_thinking": True}
    resumed = hermes.tokenizer.encode("hm</think>", add_special_tokens=False)
    request = CanonicalRequest(
        messages=USER_HI, tools=[strict], chat_template_kwargs=thinking, resumed=resumed
    )
    prepared = preprocess(add_frame(RequestKind.CHAT, request, max_tokens=32))
    assert prepared.resumed == len(resumed)
    guide = prepared.guide
    assert guide is not None and guide.thinking  # not the state after the resumed </think>
    for token in resumed:
        guide.consume(token)
    assert not guide.thinking and guide.error is None


def test_a_strict_tool_on_a_format_that_cannot_hold_it(hermes: Loaded) -> None:
    """A 400 naming `tools` by default; served with its calls parsed as written under
    engine.strict_tools = "best_effort"."""
    strict = msgspec.structs.replace(WEATHER, strict=True)
    request = CanonicalRequest(messages=USER_HI, tools=[strict])
    pythonic = EngineOptions(tool_parser="pythonic")
    refused = Preprocessor(hermes.tokenizer, pythonic, max_context=4096)
    error = preprocess_error(refused, add_frame(RequestKind.CHAT, request)).error
    assert error.param == "tools" and "strict" in error.message
    lenient = msgspec.structs.replace(pythonic, strict_tools="best_effort")
    served = Preprocessor(hermes.tokenizer, lenient, max_context=4096)
    prepared = served(add_frame(RequestKind.CHAT, request))
    assert prepared.guide is None and prepared.parser is not None
