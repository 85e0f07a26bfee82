"""OpenAI bodies -> canonical request and sampling; rejections; response bodies."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.errors import GatewayError
from gateway.openai.schemas import ChatCompletionRequest, ChatDelta, CompletionRequest
from gateway.openai.translate import (
    ChatFormatter,
    CompletionFormatter,
    chat_request,
    completion_request,
    decode_body,
    error_body,
)
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    FinishReason,
    Message,
    SamplingParams,
    Usage,
)

USER = [{"role": "user", "content": "hi"}]


def enc(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def chat(**fields: Any) -> tuple[CanonicalRequest, SamplingParams]:
    body = {"model": "m", "messages": USER, **fields}
    return chat_request(decode_body(enc(body), ChatCompletionRequest))


def completion(**fields: Any) -> tuple[CanonicalRequest, SamplingParams]:
    body = {"model": "m", "prompt": "Once", **fields}
    return completion_request(decode_body(enc(body), CompletionRequest))


def rejected(call: Any, *args: Any, **kwargs: Any) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        call(*args, **kwargs)
    error = info.value
    assert error.code is ErrorCode.INVALID_REQUEST
    assert error.status == 400
    return error


# ---- valid bodies --------------------------------------------------------------------------


def test_minimal_chat_body() -> None:
    request, sampling = chat()
    assert request == CanonicalRequest(messages=[Message("user", "hi")])
    assert request.add_generation_prompt is True
    assert sampling == SamplingParams()  # OpenAI defaults: temperature 1, top_p 1, no limit


def test_minimal_completion_body() -> None:
    request, sampling = completion()
    assert request == CanonicalRequest(prompt="Once")
    assert sampling.max_tokens == 16  # the OpenAI completions default


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


def test_completion_prompt_shapes() -> None:
    assert completion(prompt=["only one"])[0] == CanonicalRequest(prompt="only one")
    assert completion(prompt=[1, 2, 3])[0] == CanonicalRequest(prompt_token_ids=[1, 2, 3])
    assert completion(prompt=[[4, 5]])[0] == CanonicalRequest(prompt_token_ids=[4, 5])
    assert completion(max_tokens=3)[1].max_tokens == 3


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
    ("max_tokens", -1),
    ("max_tokens", 0),
    ("temperature", -1),
    ("temperature", 3),
    ("top_p", 0),
    ("messages", []),
    ("stop", ["s"] * 17),
]


@pytest.mark.parametrize(("field", "value"), SCHEMA_REJECTIONS)
def test_schema_rejections_name_the_field(field: str, value: Any) -> None:
    error = rejected(chat, **{field: value})
    assert f"$.{field}" in error.message


@pytest.mark.parametrize(("field", "value"), SCHEMA_REJECTIONS)
def test_schema_rejections_set_param(field: str, value: Any) -> None:
    assert rejected(chat, **{field: value}).param == field


def test_unknown_field_is_named() -> None:
    error = rejected(chat, frequency_penalty=0, fancy_knob=1)
    assert "fancy_knob" in error.message
    error = rejected(completion, messages=USER)  # a chat field on /v1/completions
    assert "messages" in error.message


def test_unknown_role() -> None:
    error = rejected(chat, messages=[{"role": "tool", "content": "x"}])
    assert "role" in error.message


def test_missing_messages() -> None:
    body = enc({"model": "m"})
    error = rejected(chat_request, decode_body(body, ChatCompletionRequest))
    assert error.param == "messages"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
        ),
    ],
)
def test_chat_unsupported(fields: dict[str, Any], param: str) -> None:
    error = rejected(chat, **fields)
    assert error.param == param
    assert param.split("[")[0] in error.message


def test_chat_allowed_neutral_values() -> None:
    chat(n=1, logprobs=False, tool_choice="none", response_format={"type": "text"}, tools=[])


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"echo": True}, "echo"),
        ({"suffix": "tail"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"logprobs": 1}, "logprobs"),
        ({"logprobs": 0}, "logprobs"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [[1], [2]]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"n": 3}, "n"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias"),
    ],
)
def test_completion_unsupported(fields: dict[str, Any], param: str) -> None:
    assert rejected(completion, **fields).param == param


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


def test_chat_formatter_bodies() -> None:
    fmt = ChatFormatter("chat-model")
    role = json.loads(fmt.role_chunk())
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
    text = json.loads(fmt.text_chunk("Hel"))
    assert text["choices"][0]["delta"] == {"content": "Hel"}
    assert text["id"] == role["id"]
    finish = json.loads(fmt.finish_chunk(FinishReason.LENGTH))
    assert finish["choices"][0]["delta"] == {}
    assert finish["choices"][0]["finish_reason"] == "length"
    usage = json.loads(fmt.usage_chunk(Usage(prompt_tokens=4, completion_tokens=3)))
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    full = json.loads(fmt.response("Hello", FinishReason.STOP, Usage(4, 2)))
    assert full["object"] == "chat.completion"
    assert full["choices"] == [
        {
            "index": 0,
            "message": {"content": "Hello", "role": "assistant"},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ]
    assert full["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    # a chat chunk message needs a ChatDelta; an empty one carries no keys
    assert json.loads(fmt.chunk(ChatDelta()))["choices"][0]["delta"] == {}


def test_completion_formatter_bodies() -> None:
    fmt = CompletionFormatter("base-model")
    assert fmt.role_chunk() is None
    text = json.loads(fmt.text_chunk("abc"))
    assert text["object"] == "text_completion"
    assert text["id"].startswith("cmpl-")
    assert text["model"] == "base-model"
    assert text["choices"] == [{"index": 0, "text": "abc", "finish_reason": None, "logprobs": None}]
    finish = json.loads(fmt.finish_chunk(FinishReason.STOP))
    assert finish["choices"][0] == {
        "index": 0,
        "text": "",
        "finish_reason": "stop",
        "logprobs": None,
    }
    usage = json.loads(fmt.usage_chunk(None))
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    full = json.loads(fmt.response("xyz", FinishReason.LENGTH, Usage(2, 3)))
    assert full["choices"][0]["text"] == "xyz"
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["usage"]["total_tokens"] == 5
    assert full["id"] == text["id"]
