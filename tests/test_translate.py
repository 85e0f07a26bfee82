"""OpenAI bodies -> canonical requests and sampling; rejections; response bodies and SSE."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.api.common import decode_body
from gateway.api.openai.errors import error_body
from gateway.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.api.openai.translate import (
    ChatFormatter,
    CompletionFormatter,
    chat_request,
    completion_request,
)
from gateway.api.relay import DONE, Choice, total_usage
from gateway.errors import GatewayError
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    FinishReason,
    ImagePart,
    Message,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    Usage,
)

USER = [{"role": "user", "content": "hi"}]

IMG = {"url": "https://example.com/cat.png"}


def enc(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def chat(**fields: Any) -> tuple[CanonicalRequest, SamplingParams]:
    body = {"model": "m", "messages": USER, **fields}
    return chat_request(decode_body(enc(body), ChatCompletionRequest))


def completions(**fields: Any) -> list[tuple[CanonicalRequest, SamplingParams]]:
    body = {"model": "m", "prompt": "Once", **fields}
    return completion_request(decode_body(enc(body), CompletionRequest))


def completion(**fields: Any) -> tuple[CanonicalRequest, SamplingParams]:
    """A single-prompt completion body: its one (canonical, sampling) pair."""
    (job,) = completions(**fields)
    return job


def rejected(call: Any, *args: Any, **kwargs: Any) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        call(*args, **kwargs)
    error = info.value
    assert error.code is ErrorCode.INVALID_REQUEST
    assert error.status == 400
    return error


def sse(data: bytes) -> list[Any]:
    """Complete SSE events -> their JSON payloads ("[DONE]" stays a string)."""
    assert data.endswith(b"\n\n"), data
    events = []
    for event in data.split(b"\n\n")[:-1]:
        assert event.startswith(b"data: "), event
        payload = event[len(b"data: ") :]
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def one(data: bytes) -> dict[str, Any]:
    (event,) = sse(data)
    assert isinstance(event, dict)
    return event


# ---- valid bodies --------------------------------------------------------------------------


def test_minimal_chat_body() -> None:
    request, sampling = chat()
    assert request == CanonicalRequest(messages=[Message("user", "hi")])
    assert request.add_generation_prompt is True
    assert sampling == SamplingParams()  # OpenAI defaults: temperature 1, top_p 1, no limit


def test_minimal_completion_body() -> None:
    request, sampling = completion()
    assert request == CanonicalRequest(prompt="Once")
    assert sampling == SamplingParams()  # max_tokens: serve() applies 16 within the cap


def test_chat_sampling_fields_are_carried() -> None:
    _, sampling = chat(
        max_tokens=20,
        temperature=0,
        top_p=0.9,
        top_k=-1,
        min_p=0.05,
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"17": -100, "3": 2.5},
        ignore_eos=True,
        min_tokens=2,
        stop_token_ids=[5, 6],
        include_stop_str_in_output=True,
    )
    assert sampling == SamplingParams(
        max_tokens=20,
        temperature=0.0,
        top_p=0.9,
        top_k=0,
        min_p=0.05,
        seed=11,
        stop=[],
        stop_token_ids=[5, 6],
        ignore_eos=True,
        min_tokens=2,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={17: -100.0, 3: 2.5},
        include_stop_str_in_output=True,
    )


def test_stop_string_or_list() -> None:
    assert chat(stop="\n")[1].stop == ["\n"]
    assert chat(stop=["a", "bb"])[1].stop == ["a", "bb"]
    assert chat(stop=None)[1].stop == []
    assert completion(stop="END")[1].stop == ["END"]


def test_developer_role_is_system_and_text_parts_are_joined() -> None:
    messages = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "name": "bot"},
    ]
    request, _ = chat(messages=messages)
    assert request.messages == [
        Message("system", "rules"),
        Message("user", "ab"),
        Message("assistant", "", name="bot"),
    ]


def test_max_completion_tokens_is_preferred() -> None:
    assert chat(max_completion_tokens=9)[1].max_tokens == 9
    assert chat(max_tokens=9, max_completion_tokens=9)[1].max_tokens == 9
    assert chat(max_tokens=7)[1].max_tokens == 7
    assert chat()[1].max_tokens is None
    error = rejected(chat, max_tokens=5, max_completion_tokens=9)
    assert error.param == "max_completion_tokens"


def test_chat_template_options() -> None:
    request, _ = chat(add_generation_prompt=False, chat_template_kwargs={"enable_thinking": False})
    assert request.add_generation_prompt is False
    assert request.chat_template_kwargs == {"enable_thinking": False}


def test_continue_final_message() -> None:
    messages = [*USER, {"role": "assistant", "content": "Once upon"}]
    request, _ = chat(messages=messages, continue_final_message=True, chat_template_kwargs={"x": 1})
    assert request.messages[-1] == Message("assistant", "Once upon")
    assert request.add_generation_prompt is False  # continuing, not starting a new turn
    assert request.chat_template_kwargs == {"x": 1, "continue_final_message": True}
    # off (the default): nothing is added
    assert "continue_final_message" not in chat(messages=messages)[0].chat_template_kwargs
    error = rejected(chat, continue_final_message=True)  # the last message is the user's
    assert error.param == "continue_final_message"


def test_chat_n_and_logprobs_are_served() -> None:
    _, sampling = chat(n=3, seed=5)
    assert sampling.seed == 5  # choice i gets seed + i when submitted (gateway/api/serve.py)
    assert (sampling.logprobs, sampling.top_logprobs) == (False, 0)
    assert chat(logprobs=True)[1].logprobs is True
    assert chat(logprobs=True)[1].top_logprobs == 0
    _, sampling = chat(logprobs=True, top_logprobs=20)
    assert (sampling.logprobs, sampling.top_logprobs) == (True, 20)
    _, sampling = chat(logprobs=False, top_logprobs=0)  # a neutral value
    assert (sampling.logprobs, sampling.top_logprobs) == (False, 0)


def test_completion_prompt_shapes() -> None:
    assert completion(prompt=["only one"])[0] == CanonicalRequest(prompt="only one")
    assert completion(prompt=[1, 2, 3])[0] == CanonicalRequest(prompt_token_ids=[1, 2, 3])
    assert completion(prompt=[[4, 5]])[0] == CanonicalRequest(prompt_token_ids=[4, 5])
    assert completion(max_tokens=3)[1].max_tokens == 3


def test_completion_prompt_batches() -> None:
    """A list of prompts is one job per prompt, in order, all with the same sampling."""
    jobs = completions(prompt=["a", "b", "c"], max_tokens=4, n=2)
    assert [request for request, _ in jobs] == [
        CanonicalRequest(prompt="a"),
        CanonicalRequest(prompt="b"),
        CanonicalRequest(prompt="c"),
    ]
    assert {sampling.max_tokens for _, sampling in jobs} == {4}
    jobs = completions(prompt=[[1, 2], [3]])
    assert [request.prompt_token_ids for request, _ in jobs] == [[1, 2], [3]]


def test_completion_echo_and_logprobs() -> None:
    _, sampling = completion(echo=True, logprobs=1, max_tokens=0)
    assert (sampling.echo, sampling.logprobs, sampling.top_logprobs) == (True, True, 1)
    assert sampling.max_tokens == 0  # scoring only
    _, sampling = completion(logprobs=0)  # the sampled token only, no alternatives
    assert (sampling.logprobs, sampling.top_logprobs) == (True, 0)
    _, sampling = completion(echo=True)
    assert (sampling.echo, sampling.logprobs) == (True, False)
    assert completion()[1].logprobs is False
    assert completion(best_of=3, n=3)[1] == SamplingParams()


# ---- rejections ------------------------------------------------------------------------------


def test_invalid_json() -> None:
    error = rejected(decode_body, b'{"model": "m", ', ChatCompletionRequest)
    assert "JSON" in error.message
    assert error.param is None


def test_empty_body() -> None:
    error = rejected(decode_body, b"", CompletionRequest)
    assert "empty" in error.message


SCHEMA_REJECTIONS = [
    ("max_tokens", "x"),
    ("max_tokens", "8"),
    ("max_tokens", -1),
    ("max_tokens", 0),
    ("temperature", -1),
    ("temperature", 3),
    ("top_p", 0),
    ("messages", []),
    ("stop", ["s"] * 17),
    ("n", 0),
    ("top_logprobs", 21),
    ("top_logprobs", -1),
    ("logprobs", 1),
]


@pytest.mark.parametrize(("field", "value"), SCHEMA_REJECTIONS)
def test_schema_rejections_name_the_field(field: str, value: Any) -> None:
    error = rejected(chat, **{field: value})
    assert f"$.{field}" in error.message


@pytest.mark.parametrize(("field", "value"), SCHEMA_REJECTIONS)
def test_schema_rejections_set_param(field: str, value: Any) -> None:
    assert rejected(chat, **{field: value}).param == field


@pytest.mark.parametrize(
    ("field", "value"),
    [("logprobs", 21), ("logprobs", True), ("max_tokens", -1), ("echo", "yes"), ("n", 0)],
)
def test_completion_schema_rejections_set_param(field: str, value: Any) -> None:
    assert rejected(completion, **{field: value}).param == field


def test_unknown_field_is_named() -> None:
    error = rejected(chat, frequency_penalty=0, fancy_knob=1)
    assert "fancy_knob" in error.message
    assert error.param == "fancy_knob"
    error = rejected(completion, messages=USER)  # a chat field on /v1/completions
    assert "messages" in error.message
    error = rejected(chat, stream_options={"include_usage": True, "chunk_size": 4})
    assert error.param == "stream_options.chunk_size"


def test_unknown_role() -> None:
    error = rejected(chat, messages=[{"role": "function", "content": "x"}])
    assert "role" in error.message


def test_missing_messages() -> None:
    body = enc({"model": "m"})
    error = rejected(chat_request, decode_body(body, ChatCompletionRequest))
    assert error.param == "messages"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"store": True}, "store"),
        ({"metadata": {"k": "v"}}, "metadata"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"verbosity": "low"}, "verbosity"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"modalities": ["audio"]}, "modalities"),
    ],
)
def test_chat_unsupported(fields: dict[str, Any], param: str) -> None:
    error = rejected(chat, **fields)
    assert error.param == param
    assert param.split("[")[0] in error.message


def test_chat_images_pass_named_by_their_field() -> None:
    """Images are served: each carries its field's path; a model that takes none is
    refused by the capability check (tests/test_images.py, test_workers_capabilities)."""
    content = [{"type": "text", "text": "what?"}, {"type": "image_url", "image_url": IMG}]
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": content}]
    canonical, _ = chat(messages=messages)
    assert canonical.messages[1].parts[1] == ImagePart(
        url=IMG["url"], where="messages[1].content[1].image_url.url"
    )
    assert canonical.needs() == ["vision"]


def test_legacy_function_calling_points_at_tools() -> None:
    assert "use `tools`" in rejected(chat, functions=[{"name": "f"}]).message
    assert "use `tool_choice`" in rejected(chat, function_call="auto").message


def test_chat_allowed_neutral_values() -> None:
    chat(
        n=1,
        logprobs=False,
        tool_choice="none",
        response_format={"type": "text"},
        tools=[],
        store=False,
        modalities=["text"],
        parallel_tool_calls=False,
        service_tier="auto",
        user="u",
        safety_identifier="s",
        prompt_cache_key="k",
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"suffix": "tail"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"best_of": 2, "n": 3}, "best_of"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1], 2]}, "prompt"),
        ({"prompt": [-1]}, "prompt[0]"),
        ({"prompt": True}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "echo": False}, "max_tokens"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias"),
        ({"store": True}, "store"),
    ],
)
def test_completion_unsupported(fields: dict[str, Any], param: str) -> None:
    assert rejected(completions, **fields).param == param


def test_completion_neutral_values_are_accepted() -> None:
    completion(echo=False, suffix="", best_of=1)


def test_error_body_shape() -> None:
    error = GatewayError(ErrorCode.INVALID_REQUEST, "bad n", "n")
    body = json.loads(ChatFormatter("m").encode(error_body(error)))
    assert body == {
        "error": {
            "message": "bad n",
            "type": "invalid_request_error",
            "param": "n",
            "code": "invalid_request",
        }
    }


# ---- response bodies -------------------------------------------------------------------------

TOP = [TopLogprob(7, "Hel", -0.25), TopLogprob(9, "Yo", -1.5)]
HEL = TokenLogprob(7, "Hel", -0.25, TOP)


def delta(text: str = "", tokens: list[int] | None = None, **fields: Any) -> RequestOutput:
    return RequestOutput("r", text=text, token_ids=tokens or [], **fields)


def done(reason: FinishReason = FinishReason.STOP, **fields: Any) -> RequestOutput:
    return RequestOutput("r", finish_reason=reason, **fields)


def test_chat_formatter_stream() -> None:
    fmt = ChatFormatter("chat-model", include_usage=True)
    first = delta("Hel", [7], usage=Usage(prompt_tokens=4, completion_tokens=1))
    role = one(fmt.stream_start(first))
    assert role["object"] == "chat.completion.chunk"
    assert role["id"].startswith("chatcmpl-")
    assert role["model"] == "chat-model"
    assert isinstance(role["created"], int)
    assert role["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "finish_reason": None,
            "logprobs": None,
        }
    ]
    text = one(fmt.stream_delta(0, first))
    assert text["choices"] == [
        {"index": 0, "delta": {"content": "Hel"}, "finish_reason": None, "logprobs": None}
    ]
    assert text["id"] == role["id"]
    assert fmt.stream_delta(0, delta("", [8])) == b""  # text held back: nothing to send
    finish = one(fmt.stream_finish(0, done(FinishReason.LENGTH)))
    assert finish["choices"][0]["delta"] == {}
    assert finish["choices"][0]["finish_reason"] == "length"
    *usage_events, last = sse(fmt.stream_end(Usage(4, 3, cached_tokens=2)))
    assert last == "[DONE]"
    (usage,) = usage_events
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert ChatFormatter("m").stream_end(Usage(1, 1)) == DONE  # without include_usage


def test_chat_formatter_stream_with_n_choices() -> None:
    fmt = ChatFormatter("m", n=3)
    roles = sse(fmt.stream_start(delta("x", [1])))
    assert [e["choices"][0]["index"] for e in roles] == [0, 1, 2]
    assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": ""} for e in roles)
    assert len({e["id"] for e in roles}) == 1
    assert one(fmt.stream_delta(2, delta("z", [3])))["choices"][0]["index"] == 2
    finish = one(fmt.stream_finish(1, done()))["choices"][0]
    assert (finish["index"], finish["finish_reason"]) == (1, "stop")


def test_chat_formatter_logprobs() -> None:
    fmt = ChatFormatter("m", logprobs=True)
    chunk = one(fmt.stream_delta(0, delta("Hel", [7], logprobs=[HEL])))
    assert chunk["choices"][0]["logprobs"] == {
        "content": [
            {
                "token": "Hel",
                "logprob": -0.25,
                "bytes": [72, 101, 108],
                "top_logprobs": [
                    {"token": "Hel", "logprob": -0.25, "bytes": [72, 101, 108]},
                    {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]},
                ],
            }
        ],
        "refusal": None,
    }
    # a token whose text is held back (half a UTF-8 character) still reports its logprob
    held = TokenLogprob(200, "\ufffd", -3.0)
    chunk = one(fmt.stream_delta(0, delta("", [200], logprobs=[held])))
    assert chunk["choices"][0]["delta"] == {"content": ""}
    entry = chunk["choices"][0]["logprobs"]["content"][0]
    assert entry["top_logprobs"] == []
    assert entry["bytes"] == list("\ufffd".encode())
    # logprobs not asked for: none shown even if the worker sent some
    plain = one(ChatFormatter("m").stream_delta(0, delta("Hel", [7], logprobs=[HEL])))
    assert plain["choices"][0]["logprobs"] is None


def test_chat_formatter_response() -> None:
    fmt = ChatFormatter("m", n=2, logprobs=True)
    a, b = Choice(0), Choice(1)
    a.add(delta("Hel", [7], logprobs=[HEL]))
    a.add(done(FinishReason.STOP, usage=Usage(4, 1)))
    b.add(done(FinishReason.LENGTH, text="Yo", token_ids=[9], usage=Usage(4, 1)))
    full = json.loads(fmt.response([a, b], Usage(4, 2, cached_tokens=3)))
    assert full["object"] == "chat.completion"
    assert full["id"].startswith("chatcmpl-")
    assert [c["index"] for c in full["choices"]] == [0, 1]
    assert full["choices"][0]["message"] == {"content": "Hel", "role": "assistant"}
    assert full["choices"][0]["finish_reason"] == "stop"
    assert full["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.25
    assert full["choices"][1]["message"]["content"] == "Yo"
    assert full["choices"][1]["finish_reason"] == "length"
    assert full["choices"][1]["logprobs"] == {"content": [], "refusal": None}
    assert full["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    plain = json.loads(ChatFormatter("m").response([a], Usage(4, 1)))
    assert plain["choices"][0]["logprobs"] is None


def test_formatters_stream_error() -> None:
    error = GatewayError(ErrorCode.CANCELLED, "request r was cancelled")
    for fmt in (ChatFormatter("m"), CompletionFormatter("m", [None])):
        body, last = sse(fmt.stream_error(error))
        assert last == "[DONE]"
        assert body["error"]["code"] == "cancelled"
        assert body["error"]["message"] == "request r was cancelled"


def test_completion_formatter_stream() -> None:
    fmt = CompletionFormatter("base-model", ["Once", "Once"], include_usage=True)
    first = delta("abc", [1])
    assert fmt.stream_start(first) == b""  # no role chunk in completions
    text = one(fmt.stream_delta(1, first))
    assert text["object"] == "text_completion"
    assert text["id"].startswith("cmpl-")
    assert text["model"] == "base-model"
    assert text["choices"] == [{"index": 1, "text": "abc", "finish_reason": None, "logprobs": None}]
    assert fmt.stream_delta(0, delta("", [2])) == b""
    finish = one(fmt.stream_finish(0, done()))
    assert finish["choices"][0] == {
        "index": 0,
        "text": "",
        "finish_reason": "stop",
        "logprobs": None,
    }
    usage, last = sse(fmt.stream_end(Usage()))
    assert last == "[DONE]"
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "total_tokens": 0,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    cached = sse(fmt.stream_end(Usage(6, 2, cached_tokens=5)))[0]
    assert cached["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    assert CompletionFormatter("m", [None]).stream_end(Usage(1, 1)) == DONE


def test_completion_formatter_response() -> None:
    fmt = CompletionFormatter("base-model", ["a", "b"])
    x, y = Choice(0), Choice(1)
    x.add(done(FinishReason.LENGTH, text="xyz", token_ids=[5, 6, 7], usage=Usage(2, 3)))
    y.add(done(FinishReason.STOP, text="", usage=Usage(2, 1)))
    full = json.loads(fmt.response([x, y], Usage(4, 4, cached_tokens=1)))
    assert full["object"] == "text_completion"
    assert full["choices"] == [
        {"index": 0, "text": "xyz", "finish_reason": "length", "logprobs": None},
        {"index": 1, "text": "", "finish_reason": "stop", "logprobs": None},
    ]
    assert full["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 4,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


PROMPT_LOGPROBS = [
    TokenLogprob(1, "Once"),
    TokenLogprob(2, " up", -2.0, [TopLogprob(3, " a", -1.0)]),
]


def test_completion_echo_with_logprobs_stream() -> None:
    """lm-evaluation-harness's shape: the prompt's tokens first, the first logprob null,
    text_offset running through prompt and completion."""
    fmt = CompletionFormatter("m", ["Once up"], echo=True, logprobs=1)
    on = TokenLogprob(4, "on", -0.5, [TopLogprob(4, "on", -0.5)])
    first = delta("on", [4], logprobs=[on], prompt_text="Once up", prompt_logprobs=PROMPT_LOGPROBS)
    choice = one(fmt.stream_delta(0, first))["choices"][0]
    assert choice["text"] == "Once upon"
    assert choice["logprobs"] == {
        "tokens": ["Once", " up", "on"],
        "token_logprobs": [None, -2.0, -0.5],
        "top_logprobs": [None, {" a": -1.0}, {"on": -0.5}],
        "text_offset": [0, 4, 7],
    }
    # later deltas: no prompt again, offsets continue
    more = one(fmt.stream_delta(0, delta(" a", [3], logprobs=[TokenLogprob(3, " a", -0.1)])))
    assert more["choices"][0]["text"] == " a"
    assert more["choices"][0]["logprobs"]["text_offset"] == [9]
    assert more["choices"][0]["logprobs"]["top_logprobs"] == [{}]


def test_completion_echo_scoring_only_response() -> None:
    """max_tokens 0: the prompt alone; token ids as the prompt: its decoded text."""
    fmt = CompletionFormatter("m", [None, "given"], echo=True, logprobs=0)
    scored = Choice(0)
    scored.add(
        done(
            FinishReason.LENGTH,
            usage=Usage(prompt_tokens=2),
            prompt_text="Once up",
            prompt_logprobs=PROMPT_LOGPROBS,
        )
    )
    plain = Choice(1)
    plain.add(done(FinishReason.LENGTH, prompt_text="decoded", usage=Usage(prompt_tokens=1)))
    full = json.loads(fmt.response([scored, plain], Usage(prompt_tokens=3)))
    first, second = full["choices"]
    assert first["text"] == "Once up"  # decoded from the ids
    assert first["finish_reason"] == "length"
    assert first["logprobs"]["tokens"] == ["Once", " up"]
    assert first["logprobs"]["token_logprobs"] == [None, -2.0]
    assert first["logprobs"]["text_offset"] == [0, 4]
    assert second["text"] == "given"  # the prompt as sent wins over its decoding
    assert full["usage"]["prompt_tokens"] == 3 and full["usage"]["total_tokens"] == 3


def test_completion_echo_without_logprobs() -> None:
    fmt = CompletionFormatter("m", ["Hi"], echo=True)
    first = delta(" there", [5], prompt_text="Hi", prompt_logprobs=[])
    choice = one(fmt.stream_delta(0, first))["choices"][0]
    assert choice == {"index": 0, "text": "Hi there", "finish_reason": None, "logprobs": None}
    # no echo asked: the prompt is not repeated even if the worker sent it
    fmt = CompletionFormatter("m", ["Hi"])
    assert one(fmt.stream_delta(0, first))["choices"][0]["text"] == " there"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"stop": ""}, "stop"),
        ({"stop": ["a", ""]}, "stop"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"logit_bias": {str(2**40): 1}}, "logit_bias"),
    ],
)
def test_silently_meaningless_values_are_refused(fields: dict[str, Any], param: str) -> None:
    assert rejected(chat, **fields).param == param
    assert rejected(completion, **fields).param == param


def test_usage_parses_in_the_openai_sdk() -> None:
    from openai.types import CompletionUsage

    body = ChatFormatter("m").response([Choice(0)], Usage(10, 2, cached_tokens=8))
    usage = CompletionUsage.model_validate(json.loads(body)["usage"])
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 8


def test_total_usage_counts_a_prompt_and_its_cached_tokens_once() -> None:
    """n choices of one prompt share its count and its cache hit; completions add up."""
    usages: list[Usage | None] = [Usage(10, 3, 8), Usage(10, 4, 10), Usage(6, 1, 0), None]
    assert total_usage(usages, [0, 0, 1, 1]) == Usage(16, 8, 8)
