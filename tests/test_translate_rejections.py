"""OpenAI bodies the gateway refuses with a 400 naming the field: invalid JSON, schema
violations, unknown fields and roles, unsupported and silently meaningless values (and the
neutral values that pass); images pass named by their field; the error body's shape."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.api.common import decode_body
from gateway.api.openai.errors import error_body
from gateway.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.api.openai.translate import ChatFormatter, chat_request
from gateway.api.responses.schemas import ResponsesRequest
from gateway.errors import GatewayError
from shared.types import ErrorCode, ImagePart
from tests.openai_bodies import USER, chat, completion, completions, enc, rejected

IMG = {"url": "https://example.com/cat.png"}


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
    ("stop", "s" * 1025),
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


def test_a_stop_string_is_bounded_in_length() -> None:  # each is checked at every token
    assert rejected(chat, stop=["ok", "s" * 1025]).param == "stop[1]"


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


def test_a_null_for_a_field_openai_types_as_optional_is_its_default() -> None:
    """Wrappers forward the SDK's optional arguments as they hold them: `n=None` and the
    like are the defaults, as on OpenAI's API."""
    nulls = {"n": None, "stream": None, "logprobs": None}
    body = decode_body(enc({"model": "m", "messages": USER, **nulls}), ChatCompletionRequest)
    assert (body.n, body.stream, body.logprobs) == (1, False, False)
    assert chat(**nulls) == chat()
    done = decode_body(enc({"model": "m", "prompt": "a", "echo": None}), CompletionRequest)
    assert (done.echo, done.n) == (False, 1)
    raw = {"model": "m", "input": "hi", "stream": None, "store": None, "background": None}
    responses = decode_body(enc(raw), ResponsesRequest)
    assert (responses.stream, responses.store, responses.background) == (False, True, False)
    assert decode_body(enc({**raw, "store": False}), ResponsesRequest).store is False
    assert rejected(chat, n=0).param == "n"  # a value is still checked


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
