"""Tools, thinking and structured output end to end: the official openai and anthropic SDKs,
a real gateway, real worker processes over tiny models whose templates render tools and
thinking in two formats (Hermes/Qwen JSON calls, Qwen3-Coder XML calls).

The weights are random, so a model never decides to call a tool: every call here is forced
(a required or named tool choice), and every JSON output is forced by its schema. That is
the point: constrained decoding gives valid output from any weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from gateway.api.responses.translate import seal
from tests.gateway_proc import GatewayProc, openai_client, running_gateway

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"type": "string", "enum": ["metric", "imperial"]},
    },
    "required": ["city", "days", "units"],
    "additionalProperties": False,
}
ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"],
    "additionalProperties": False,
}
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "add", "parameters": ADD_SCHEMA}},
]
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 20},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["answer", "score", "tags", "ok"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
MODELS = ("hermes", "coder")


@pytest.fixture(scope="module")
def agents(hermes_model_dir: Path, coder_model_dir: Path) -> Iterator[GatewayProc]:
    # thinking off unless a request asks (as the demo model): random weights never end it
    off = {"enable_thinking": False}
    models = [
        {"name": "hermes", "source": str(hermes_model_dir), "chat_template_kwargs": off},
        {"name": "coder", "source": str(coder_model_dir), "chat_template_kwargs": off},
    ]
    # a call format that cannot be constrained (the Hermes model read as pythonic), with
    # strict tools refused (the default) and served unchecked
    for name, strict in (("pythonic", "enforce"), ("pythonic-lenient", "best_effort")):
        engine = {"tool_parser": "pythonic", "strict_tools": strict}
        models.append({"name": name, "source": str(hermes_model_dir), "engine": engine})
    with running_gateway(models, request_timeout_s=60.0, hosted_tools="omit") as gw:
        yield gw


@pytest.fixture(scope="module")
def oai(agents: GatewayProc) -> openai.OpenAI:
    return openai_client(agents)


@pytest.fixture(scope="module")
def claude(agents: GatewayProc) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=agents.base_url, api_key="x", max_retries=0)


def streamed_calls(chunks: list[Any]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call, joined from the stream's tool-call deltas."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(delta.index, ["", "", ""])
            entry[0] += delta.id or ""
            if delta.function is not None:
                entry[1] += delta.function.name or ""
                entry[2] += delta.function.arguments or ""
    return [(i, n, a) for i, n, a in (calls[k] for k in sorted(calls))]


@pytest.mark.parametrize("model", MODELS)
def test_openai_forced_call_stream_and_non_stream_agree(oai: openai.OpenAI, model: str) -> None:
    args: dict[str, Any] = {
        "model": model,
        "messages": ASK,
        "tools": OPENAI_TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0,
        "max_tokens": 120,
        "extra_body": NO_THINKING,
    }
    whole = oai.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) >= 1 and not choice.message.content
    call = calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)

    chunks = list(oai.chat.completions.create(**args, stream=True))
    streamed = streamed_calls(chunks)
    assert [(n, a) for _, n, a in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not c.choices[0].delta.content for c in chunks if c.choices)
    if model == "hermes":  # JSON calls stream their arguments as they are generated
        # (a reader that lags gets the deltas waiting for it merged into one, so on a loaded
        # machine one stream may carry them whole: a parser that held them back until the
        # call ended would do so in every one)
        for _ in range(3):
            pieces = [
                d.function.arguments
                for c in chunks
                if c.choices
                for d in c.choices[0].delta.tool_calls or []
                if d.function is not None and d.function.arguments
            ]
            if len(pieces) > 1:
                break
            chunks = list(oai.chat.completions.create(**args, stream=True))
        assert len(pieces) > 1


@pytest.mark.parametrize("model", MODELS)
def test_openai_required_one_call_then_a_tool_result_turn(oai: openai.OpenAI, model: str) -> None:
    first = oai.chat.completions.create(
        model=model,
        messages=ASK,
        tools=OPENAI_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        max_tokens=120,
        extra_body=NO_THINKING,
    )
    calls = first.choices[0].message.tool_calls or []
    assert first.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    schema = {"get_weather": WEATHER_SCHEMA, "add": ADD_SCHEMA}[calls[0].function.name]
    jsonschema.validate(json.loads(calls[0].function.arguments), schema)
    history = [
        *ASK,
        first.choices[0].message.model_dump(),  # as the SDK returns it, nulls and all
        {"role": "tool", "tool_call_id": calls[0].id, "content": "12C and rain"},
    ]
    second = oai.chat.completions.create(
        model=model, messages=history, tools=OPENAI_TOOLS, max_tokens=8, extra_body=NO_THINKING
    )
    assert second.choices[0].finish_reason in ("length", "stop", "tool_calls")
    usage = second.usage
    assert usage is not None and usage.prompt_tokens > (first.usage or usage).prompt_tokens


@pytest.mark.parametrize("model", MODELS)
def test_anthropic_forced_tool_use_stream_and_non_stream_agree(
    claude: anthropic.Anthropic, model: str
) -> None:
    args: dict[str, Any] = {
        "model": model,
        "max_tokens": 120,
        "messages": ASK,
        "tools": [{"name": "get_weather", "input_schema": WEATHER_SCHEMA}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "thinking": {"type": "disabled"},
        "extra_body": {"temperature": 0},
    }
    message = claude.messages.create(**args)
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
    with claude.messages.stream(**args) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in events or "content_block_delta" in events
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (u.name, u.input) for u in uses
    ]
    # the result turn continues the conversation
    reply = claude.messages.create(
        model=model,
        max_tokens=8,
        tools=args["tools"],
        thinking={"type": "disabled"},
        messages=[
            *ASK,
            {"role": "assistant", "content": [u.model_dump() for u in uses]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "12C"}],
            },
        ],
    )

    def prompt(usage: anthropic.types.Usage) -> int:  # input_tokens leaves out cache reads
        return usage.input_tokens + (usage.cache_read_input_tokens or 0)

    assert prompt(reply.usage) > prompt(message.usage)


def test_responses_forced_function_call(oai: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": "hermes",
        "input": "What is the weather in Oslo?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "temperature": 0,
        "max_output_tokens": 120,
    }
    response = oai.responses.create(**args)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_SCHEMA)
    deltas, done = "", ""
    for event in oai.responses.create(**args, stream=True):
        if event.type == "response.function_call_arguments.delta":
            deltas += event.delta
        elif event.type == "response.function_call_arguments.done":
            done = event.arguments
    assert deltas == done == calls[0].arguments
    follow = oai.responses.create(
        model="hermes",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "12C"}],
        tools=args["tools"],
        max_output_tokens=8,
    )
    assert follow.usage is not None and response.usage is not None
    assert follow.usage.input_tokens > response.usage.input_tokens


def test_responses_stateless_turns_pass_their_sealed_reasoning_back(oai: openai.OpenAI) -> None:
    # as Codex sends its turns: store false, include reasoning.encrypted_content, and the
    # output items passed back; the sealed thinking of the turn in progress reaches the prompt
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}]
    tools.append({"type": "web_search", "external_web_access": False})  # omitted here
    args: dict[str, Any] = {"model": "hermes", "tools": tools, "store": False}
    args |= {"include": ["reasoning.encrypted_content"], "max_output_tokens": 4}
    args["extra_body"] = {"client_metadata": {"x-codex-installation-id": "test"}}
    first = oai.responses.create(input="What is the weather in Oslo?", **args)
    assert first.status == "incomplete" and first.store is False
    assert [tool.type for tool in first.tools] == ["function"]  # what the model was given
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather"}
    call["arguments"] = '{"city": "Oslo", "days": 1}'
    said = {"type": "message", "role": "assistant", "phase": "commentary", "end_turn": False}
    said["content"] = [{"type": "output_text", "text": "Checking.", "annotations": []}]
    turn: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}, said, call]
    turn.append({"type": "function_call_output", "call_id": "c1", "output": "12C"})
    thought = {"type": "reasoning", "id": "rs_1", "summary": []}
    thought["encrypted_content"] = seal("The user wants Oslo's weather; I will look it up.")
    plain = oai.responses.create(input=turn, **args)
    thinking = oai.responses.create(input=[turn[0], thought, *turn[1:]], **args)
    assert plain.usage is not None and thinking.usage is not None
    assert thinking.usage.input_tokens > plain.usage.input_tokens + 8


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates_stream_and_non_stream(
    oai: openai.OpenAI, temperature: float
) -> None:
    args: dict[str, Any] = {
        "model": "hermes",
        "messages": ASK,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True},
        },
        "temperature": temperature,
        "seed": 7,
        "max_tokens": 200,
        "extra_body": NO_THINKING,
    }
    whole = oai.chat.completions.create(**args)
    assert whole.choices[0].finish_reason == "stop"
    text = whole.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), ANSWER_SCHEMA)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in oai.chat.completions.create(**args, stream=True)
        if c.choices
    )
    assert streamed == text  # seeded: the same tokens either way
    completion = oai.completions.create(
        model="hermes",
        prompt="Answer:",
        max_tokens=200,
        temperature=temperature,
        extra_body={"response_format": args["response_format"]},
    )
    jsonschema.validate(json.loads(completion.choices[0].text), ANSWER_SCHEMA)


def test_json_mode_gives_an_object(agents: GatewayProc, oai: openai.OpenAI) -> None:
    """Any JSON object: a random model wanders inside strings for long, so the test leans
    it towards closing them (logit_bias applies before the grammar's mask)."""
    tok = httpx.post(f"{agents.base_url}/tokenize", json={"model": "hermes", "prompt": '"}'})
    quote, close = tok.json()["tokens"]
    bias = {str(quote): 40, str(close): 40}
    args: dict[str, Any] = {
        "model": "hermes",
        "messages": ASK,
        "response_format": {"type": "json_object"},
        "max_tokens": 200,
        "logit_bias": bias,
        "temperature": 0,
    }
    r = oai.chat.completions.create(**args)
    text = r.choices[0].message.content or ""
    assert isinstance(json.loads(text), dict)
    chunks = list(oai.chat.completions.create(**args, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


@pytest.mark.parametrize("model", MODELS)
def test_thinking_never_reaches_the_answer(
    oai: openai.OpenAI, claude: anthropic.Anthropic, model: str
) -> None:
    r = oai.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=30,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    message = r.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content") or ""
    assert reasoning  # the prompt opened the think block: the output starts inside it
    assert "<think>" not in (message.content or "") and "</think>" not in (message.content or "")
    assert reasoning not in (message.content or "")
    details = r.usage.completion_tokens_details if r.usage is not None else None
    assert details is not None and details.reasoning_tokens  # counted apart
    budget = claude.messages.create(
        model=model,
        max_tokens=30,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 5},
        extra_body={"temperature": 0},
    )
    kinds = [b.type for b in budget.content]
    assert kinds[0] == "thinking" and "text" in kinds  # the budget ended the thinking
    thinking = budget.content[0]
    assert thinking.type == "thinking" and thinking.thinking
    text = "".join(b.text for b in budget.content if b.type == "text")
    assert "</think>" not in text and thinking.thinking not in text


def test_capabilities_and_refusals(oai: openai.OpenAI, gateway_refusal: None = None) -> None:
    models = {m.id: m.model_extra or {} for m in oai.models.list().data}
    for name in MODELS:
        caps = models[name]["capabilities"]
        assert {"tools", "reasoning", "structured_output"} <= set(caps)
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(
            model="hermes",
            messages=ASK,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "strict": True,
                    "schema": {"type": "integer", "minimum": 5, "maximum": 1},
                },
            },
        )
    assert bad.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as unknown:
        oai.chat.completions.create(
            model="hermes",
            messages=ASK,
            tools=OPENAI_TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert unknown.value.body["param"] == "tool_choice"  # type: ignore[index]


# ---- under tool_choice auto: the model decides; what must hold holds ---------------------------


def marker_bias(agents: GatewayProc, model: str) -> dict[str, int]:
    """The call marker made the likeliest token: random weights never choose to call."""
    tok = httpx.post(f"{agents.base_url}/tokenize", json={"model": model, "prompt": "<tool_call>"})
    (marker,) = tok.json()["tokens"]
    return {str(marker): 100}


@pytest.mark.parametrize("model", MODELS)
def test_a_strict_tools_call_under_auto_matches_its_schema(
    agents: GatewayProc, oai: openai.OpenAI, model: str
) -> None:
    """Without the grammar the bias would write nothing but markers; with it, each token
    after the marker is the likeliest one the schema allows, and the call is valid."""
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in OPENAI_TOOLS]
    r = oai.chat.completions.create(
        model=model,
        messages=ASK,
        tools=strict,  # type: ignore[arg-type]
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=150,
        logit_bias=marker_bias(agents, model),
        extra_body=NO_THINKING,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls or []
    assert call.type == "function"
    schema = {"get_weather": WEATHER_SCHEMA, "add": ADD_SCHEMA}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_response_format_beside_tools_is_its_json_or_a_call(
    agents: GatewayProc, oai: openai.OpenAI
) -> None:
    """The model decides (here: the marker's bias, one way or the other): the answer is
    the format's JSON, or the output is calls."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    args: dict[str, Any] = {
        "model": "hermes",
        "messages": ASK,
        "tools": OPENAI_TOOLS,
        "parallel_tool_calls": False,
        "response_format": fmt,
        "temperature": 0,
        "max_tokens": 200,
        "extra_body": NO_THINKING,
    }
    bias = marker_bias(agents, "hermes")
    answer = oai.chat.completions.create(**args, logit_bias={k: -100 for k in bias})
    assert answer.choices[0].finish_reason == "stop", answer.choices[0].message
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), ANSWER_SCHEMA)
    called = oai.chat.completions.create(**args, logit_bias=bias)
    assert called.choices[0].finish_reason == "tool_calls", called.choices[0].message
    assert not called.choices[0].message.content
    (call,) = called.choices[0].message.tool_calls or []
    assert call.type == "function" and call.function.name in ("get_weather", "add")


def test_no_call_starts_inside_the_think_block_of_a_strict_tools_output(
    agents: GatewayProc, oai: openai.OpenAI
) -> None:
    """A call written while thinking would escape the schema: under the grammar its marker
    is not written there, however likely (the bias) the model makes it."""
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in OPENAI_TOOLS]
    r = oai.chat.completions.create(
        model="hermes",
        messages=ASK,
        tools=strict,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=24,
        logit_bias=marker_bias(agents, "hermes"),
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    message = r.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content") or ""
    assert reasoning and "<tool_call>" not in reasoning
    assert not message.tool_calls and r.choices[0].finish_reason == "length"


def test_a_strict_tool_on_a_format_that_cannot_hold_it(oai: openai.OpenAI) -> None:
    """Refused with a 400 naming `tools` by default (never silently unchecked); served, its
    calls unchecked, where the operator set engine.strict_tools = "best_effort"."""
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in OPENAI_TOOLS]
    args: dict[str, Any] = {"messages": ASK, "tools": strict, "max_tokens": 4}
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model="pythonic", **args)
    assert refused.value.body is not None
    error = refused.value.body if isinstance(refused.value.body, dict) else {}
    assert error.get("param") == "tools" and "best_effort" in str(error.get("message"))
    served = oai.chat.completions.create(model="pythonic-lenient", **args)
    assert served.choices[0].finish_reason in ("length", "stop", "tool_calls")
