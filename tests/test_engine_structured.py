"""Constrained rows inside a running batch, over each continuous batch: a schema's output
validates at any temperature, a forced call is valid, a thinking budget ends the thinking,
and the unconstrained rows beside them make exactly the tokens they make alone."""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path

import jsonschema
import pytest

from shared.config import EngineOptions
from shared.protocol import Add
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    FinishReason,
    Message,
    OutputFormat,
    Reasoning,
    RequestKind,
    RequestOutput,
    ResponseFormat,
    SamplingParams,
    Tool,
    ToolChoice,
    ToolChoiceMode,
)
from tests.engine_fixtures import Loaded, drive, load, text, token_ids
from worker.preprocess import PreparedRequest, Preprocessor
from worker.structured.guide import beyond_limits, first_line

pytestmark = pytest.mark.usefixtures("batcher")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "n": {"type": "integer", "minimum": -5, "maximum": 500},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}
TOOL = Tool(
    "lookup",
    "Look a word up",
    {
        "type": "object",
        "properties": {
            "word": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["word", "n"],
        "additionalProperties": False,
    },
)
OFF = {"enable_thinking": False}


@pytest.fixture(scope="module")
def hermes(hermes_model_dir: Path) -> Loaded:
    return load(hermes_model_dir)


def prepare(
    loaded: Loaded, rid: str, request: CanonicalRequest, **sampling: object
) -> PreparedRequest:
    preprocess = Preprocessor(loaded.tokenizer, EngineOptions(), max_context=4096)
    params = SamplingParams(**sampling)  # type: ignore[arg-type]
    return preprocess(Add(rid, RequestKind.CHAT, request, params))


def chat(**fields: object) -> CanonicalRequest:
    return CanonicalRequest(messages=[Message("user", "Hello there")], **fields)  # type: ignore[arg-type]


def calls(deltas: list[RequestOutput]) -> list[tuple[str, str, str]]:
    joined: dict[int, list[str]] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            entry = joined.setdefault(piece.index, ["", "", ""])
            entry[0] += piece.id
            entry[1] += piece.name
            entry[2] += piece.arguments
    return [(i, n, a) for i, n, a in (joined[k] for k in sorted(joined))]


def test_constrained_rows_leave_their_neighbours_alone(hermes: Loaded) -> None:
    plain = chat(chat_template_kwargs=OFF)
    alone = drive(
        hermes.engine(),
        [prepare(hermes, "p", plain, max_tokens=24, temperature=0.0, ignore_eos=True)],
    )["p"]
    fmt = ResponseFormat(OutputFormat.JSON_SCHEMA, SCHEMA, strict=True)
    batch = [
        prepare(hermes, "p", plain, max_tokens=24, temperature=0.0, ignore_eos=True),
        *(
            prepare(
                hermes,
                f"j{i}",
                chat(response_format=fmt, chat_template_kwargs=OFF),
                max_tokens=120,
                temperature=1.0,
                seed=i,
            )
            for i in range(3)
        ),
    ]
    out = drive(hermes.engine(), batch)
    assert token_ids(out["p"]) == token_ids(alone)  # the same greedy tokens as alone
    for i in range(3):
        deltas = out[f"j{i}"]
        assert deltas[-1].finish_reason is FinishReason.STOP  # the grammar completed
        jsonschema.validate(json.loads(text(deltas)), SCHEMA)


def test_a_forced_call_is_valid_and_ends_the_turn(hermes: Loaded) -> None:
    request = chat(
        tools=[TOOL],
        tool_choice=ToolChoice(ToolChoiceMode.REQUIRED, "lookup"),
        chat_template_kwargs=OFF,
    )
    out = drive(hermes.engine(), [prepare(hermes, "c", request, max_tokens=80, temperature=0.0)])
    deltas = out["c"]
    assert deltas[-1].finish_reason is FinishReason.TOOL_CALLS
    assert text(deltas) == ""  # the markup never reaches the answer
    [(call_id, name, arguments)] = calls(deltas)
    assert call_id.startswith("call_") and name == "lookup"
    jsonschema.validate(json.loads(arguments), TOOL.parameters)


def test_a_thinking_budget_ends_the_thinking(hermes: Loaded) -> None:
    request = chat(reasoning=Reasoning(enabled=True, budget_tokens=4))
    out = drive(hermes.engine(), [prepare(hermes, "t", request, max_tokens=16, temperature=0.0)])
    deltas = out["t"]
    reasoning = "".join(d.reasoning for d in deltas)
    assert reasoning and "<think>" not in text(deltas) and "</think>" not in text(deltas)
    end = hermes.tokenizer.convert_tokens_to_ids("</think>")
    assert token_ids(deltas)[4] == end  # forced right after the fourth thinking token
    usage = deltas[-1].usage
    assert usage is not None and usage.reasoning_tokens == 5  # the marker is thinking too


def test_rows_joining_and_leaving_around_a_constrained_row_keep_every_mask_on_its_row(
    hermes: Loaded,
) -> None:
    """Rows join and leave while constrained rows decode (the rows batch computes their
    masks a step ahead, for the batch as it was): each greedy row makes the tokens it makes
    alone, and each schema's output completes and validates."""
    fmt = ResponseFormat(OutputFormat.JSON_SCHEMA, SCHEMA, strict=True)
    plain = chat(chat_template_kwargs=OFF)
    constrained = chat(response_format=fmt, chat_template_kwargs=OFF)

    def requests() -> list[PreparedRequest]:
        return [
            prepare(hermes, "j0", constrained, max_tokens=120, temperature=0.0),
            prepare(hermes, "p0", plain, max_tokens=5, temperature=0.0, ignore_eos=True),
            prepare(hermes, "j1", constrained, max_tokens=120, temperature=0.0),
            prepare(hermes, "p1", plain, max_tokens=30, temperature=0.0, ignore_eos=True),
        ]

    alone = {r.request_id: drive(hermes.engine(), [r])[r.request_id] for r in requests()}
    engine = hermes.engine()
    out: dict[str, list[RequestOutput]] = {}
    for request in requests():  # one joins every third step
        engine.add(request)
        for _ in range(3):
            for output in engine.step():
                out.setdefault(output.request_id, []).append(output)
    for rid, deltas in drive(engine, []).items():
        out.setdefault(rid, []).extend(deltas)
    for rid, deltas in out.items():
        assert token_ids(deltas) == token_ids(alone[rid]), rid
        assert sum(d.finish_reason is not None for d in deltas) == 1
    for rid in ("j0", "j1"):
        assert out[rid][-1].finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(text(out[rid])), SCHEMA)


def test_a_constrained_request_right_after_a_lone_ones_first_token_keeps_its_own(
    hermes: Loaded,
) -> None:
    """engine.first_token_read: a constrained request added in the call after a lone
    request's first token (read early, or once the next step was built) gets every token
    its guide took: the same valid JSON either way."""
    fmt = ResponseFormat(OutputFormat.JSON_SCHEMA, SCHEMA, strict=True)
    texts = {}
    for read in ("pipelined", "early"):
        engine = hermes.engine(batcher="rows", first_token="prefill", first_token_read=read)
        plain = prepare(hermes, "p", chat(chat_template_kwargs=OFF), max_tokens=30, temperature=0.0)
        constrained = prepare(
            hermes,
            "j",
            chat(response_format=fmt, chat_template_kwargs=OFF),
            max_tokens=120,
            temperature=0.0,
        )
        assert constrained.guide is not None and constrained.guide.compiling is not None
        constrained.guide.compiling.result(timeout=60)  # compiled before it arrives
        engine.add(plain)
        assert [o.request_id for o in engine.step() if o.token_ids] == ["p"]
        engine.settle()
        out = drive(engine, [constrained])
        assert out["j"][-1].finish_reason is FinishReason.STOP
        texts[read] = text(out["j"])
        jsonschema.validate(json.loads(texts[read]), SCHEMA)
    assert texts["early"] == texts["pipelined"]


def test_a_grammar_still_compiling_holds_its_request_alone(hermes: Loaded) -> None:
    # its compile on the grammar thread (here, by hand): the plain request runs to its end
    # meanwhile; once compiled the constrained one follows its schema; a failed compile is
    # that request's 400, naming its field
    fmt = ResponseFormat(OutputFormat.JSON_SCHEMA, SCHEMA, param="response_format", strict=True)
    constrained = prepare(hermes, "j", chat(response_format=fmt, chat_template_kwargs=OFF))
    grammar = constrained.guide
    assert grammar is not None and grammar.compiling is not None
    done = grammar.compiling
    held: Future[object] = Future()
    grammar.compiling = held
    broken = prepare(hermes, "x", chat(response_format=fmt, chat_template_kwargs=OFF))
    assert broken.guide is not None
    broken.guide.compiling = failing = Future()
    engine = hermes.engine()
    for r in (constrained, broken):
        r.max_tokens = 120
        engine.add(r)
    plain = prepare(hermes, "p", chat(chat_template_kwargs=OFF), max_tokens=6, temperature=0.0)
    engine.add(plain)
    ended = []
    for _ in range(200):  # to the plain one's end: the other two still wait
        if not engine.can_step:
            break
        ended += [o for o in engine.step() if o.finish_reason is not None]
    assert [o.request_id for o in ended] == ["p"] and engine.counts() == (0, 2)
    assert not engine.can_step and engine.has_work
    failing.set_exception(ValueError("a `$ref` to nothing"))
    held.set_result(done.result(timeout=60))
    out = drive(engine, [])
    [error] = out["x"]
    assert error.finish_reason is FinishReason.ERROR and error.error is not None
    assert error.error.param == "response_format" and "`$ref` to nothing" in error.error.message
    assert out["j"][-1].finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(text(out["j"])), SCHEMA)


def test_a_schema_beyond_llguidance_s_limits_is_a_400_naming_it(hermes: Loaded) -> None:
    # hundreds of optional properties: a row of the parse grows past llguidance's limit
    # (2,000 items) at the object's first key; the schema's size, not a fault of the server
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}
    fmt = ResponseFormat(OutputFormat.JSON_SCHEMA, wide, param="response_format", strict=True)
    request = prepare(hermes, "w", chat(response_format=fmt, chat_template_kwargs=OFF))
    request.max_tokens = 40
    [*_, last] = drive(hermes.engine(), [request])["w"]
    assert last.finish_reason is FinishReason.ERROR and last.error is not None
    assert last.error.code is ErrorCode.INVALID_REQUEST and last.error.param == "response_format"
    assert "too large for constrained decoding" in last.error.message


def test_a_grammar_that_fails_to_compile_is_answered_without_waiting_for_a_place(
    hermes: Loaded,
) -> None:
    engine = hermes.engine(max_running=1)
    busy = prepare(hermes, "b", chat(chat_template_kwargs=OFF), max_tokens=200, ignore_eos=True)
    engine.add(busy)
    engine.step()  # the batch's one place is taken for 200 tokens
    fmt = ResponseFormat(OutputFormat.JSON_SCHEMA, SCHEMA, param="response_format", strict=True)
    broken = prepare(hermes, "x", chat(response_format=fmt, chat_template_kwargs=OFF))
    assert broken.guide is not None
    broken.guide.compiling = failing = Future()
    engine.add(broken)
    failing.set_exception(ValueError("a `$ref` to nothing"))
    [error] = [o for o in engine.step() if o.request_id == "x"]  # the next step, not 200 later
    assert error.error is not None and error.error.param == "response_format"
    assert engine.request_ids() == ["b"]  # the busy one goes on


def test_llguidance_s_limits_are_told_by_its_first_line_alone() -> None:
    grammar = '{"properties": {"limit": {"description": "max is 5, too big otherwise"}}}'
    rejected = f'Parser Error: token "x" doesn\'t satisfy the grammar\n<state>\n{grammar}'
    assert not beyond_limits(rejected)
    assert first_line(rejected) == 'Parser Error: token "x" doesn\'t satisfy the grammar'
    assert beyond_limits("Parser Error: Current row has 2407 items; max is 2000; consider")
    assert beyond_limits(
        "initial lexer configuration (grammar) too big (limit for this grammar: 1)"
    )
