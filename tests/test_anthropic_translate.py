"""Anthropic Messages bodies -> canonical request and sampling; rejections; response bodies
and the SSE event sequence. Pure: no processes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.api.anthropic.formatter import MessagesFormatter, count_tokens_body, stop_reason
from gateway.api.anthropic.schemas import CountTokensRequest, MessagesRequest
from gateway.api.anthropic.translate import messages_request, prompt_request
from gateway.api.common import decode_body
from gateway.api.relay import Choice
from gateway.errors import GatewayError
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    FinishReason,
    ImagePart,
    Message,
    RequestOutput,
    SamplingParams,
    Usage,
)
from tests.responses_helpers import _parse

USER = [{"role": "user", "content": "hi"}]


def enc(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def create(**fields: Any) -> tuple[CanonicalRequest, SamplingParams]:
    body = {"model": "m", "max_tokens": 8, "messages": USER, **fields}
    return messages_request(decode_body(enc(body), MessagesRequest))


def refused(**fields: Any) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        create(**fields)
    assert info.value.code == ErrorCode.INVALID_REQUEST
    assert info.value.status == 400
    return info.value


# ---- requests ----------------------------------------------------------------------------


def test_minimal_request() -> None:
    canonical, sampling = create()
    assert canonical == CanonicalRequest(messages=[Message("user", "hi")])
    assert canonical.add_generation_prompt
    assert sampling == SamplingParams(max_tokens=8, temperature=1.0, top_p=1.0, top_k=0)


def test_sampling_fields() -> None:
    _, sampling = create(temperature=0, top_p=0.5, top_k=40, stop_sequences=["\n\n", "END"])
    assert sampling.temperature == 0.0
    assert sampling.top_p == 0.5
    assert sampling.top_k == 40
    assert sampling.stop == ["\n\n", "END"]


def test_accepted_fields_change_nothing() -> None:
    plain = create()
    assert (
        create(
            metadata={"user_id": "u-1"},
            service_tier="standard_only",
            stream=True,
            tools=[],
            tool_choice={"type": "auto"},  # nothing to choose from: no tool choice
            cache_control={"type": "ephemeral"},
        )
        == plain
    )
    assert create(service_tier="auto") == plain


def test_system_string_and_blocks() -> None:
    canonical, _ = create(system="Be brief.")
    assert canonical.messages == [Message("system", "Be brief."), Message("user", "hi")]
    blocks = [
        {"type": "text", "text": "Be "},
        {"type": "text", "text": "brief.", "cache_control": {"type": "ephemeral"}},
    ]
    assert create(system=blocks) == create(system="Be brief.")
    assert create(system="") == create()  # an empty system prompt is none


def test_content_blocks_are_joined() -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Hello, "},
                {"type": "text", "text": "world", "cache_control": {"type": "ephemeral"}},
            ],
        }
    ]
    canonical, _ = create(messages=messages)
    assert canonical.messages == [Message("user", "Hello, world")]


def test_multi_turn() -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "text", "text": "b", "citations": None}]},
        {"role": "user", "content": "c"},
    ]
    canonical, _ = create(messages=messages)
    assert [(m.role, m.content) for m in canonical.messages] == [
        ("user", "a"),
        ("assistant", "b"),
        ("user", "c"),
    ]
    assert canonical.add_generation_prompt
    assert canonical.chat_template_kwargs == {}


def test_last_assistant_message_is_a_prefill() -> None:
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    canonical, _ = create(messages=messages, system="S")
    assert canonical.messages[-1] == Message("assistant", "The answer is")
    assert canonical.messages[0] == Message("system", "S")
    assert not canonical.add_generation_prompt
    assert canonical.chat_template_kwargs == {"continue_final_message": True}


def test_an_empty_last_assistant_message_is_no_prefill() -> None:
    canonical, _ = create(messages=[*USER, {"role": "assistant", "content": ""}])
    assert canonical == create()[0]


def test_count_tokens_builds_the_same_prompt() -> None:
    messages = [*USER, {"role": "assistant", "content": "Sure"}]
    system = [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}]
    cache_control = {"type": "ephemeral", "ttl": "1h"}  # automatic caching: ignored
    body = {"model": "m", "messages": messages, "system": system, "cache_control": cache_control}
    counted = prompt_request(decode_body(enc(body), CountTokensRequest))
    assert counted == create(messages=messages, system="S")[0]
    assert json.loads(count_tokens_body(42)) == {"input_tokens": 42}


@pytest.mark.parametrize(
    ("block", "why"),
    [
        ({"type": "document", "source": {}}, "document"),
        ({"type": "redacted_thinking", "data": "x"}, "encrypted"),
        ({"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}, "server"),
        ({"type": "hologram"}, "only text"),
    ],
)
def test_unserved_content_blocks_are_named(block: dict[str, Any], why: str) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "look:"}, block]}]
    error = refused(messages=messages)
    assert error.param == "messages[0].content[1]"
    assert "`messages[0].content[1]`" in error.message
    assert why in error.message


def test_image_blocks_pass_named_by_their_source() -> None:
    """The index is the client's: `system` is no message, though it becomes the first."""
    url = {"type": "url", "url": "https://e.com/a.png"}
    data = {"type": "base64", "media_type": "image/png", "data": "iVBO"}
    content = [{"type": "image", "source": url}, {"type": "image", "source": data}]
    messages = [*USER, {"role": "assistant", "content": "ok"}, {"role": "user", "content": content}]
    canonical, _ = create(system="S", messages=messages)
    assert canonical.messages[0] == Message("system", "S")
    assert canonical.messages[3].parts == [
        ImagePart(url="https://e.com/a.png", where="messages[2].content[0].source"),
        ImagePart(b"\x89PN", "image/png", where="messages[2].content[1].source"),
    ]
    assert canonical.needs() == ["vision"]


def test_an_image_source_with_the_other_kinds_fields_is_named() -> None:
    mixed = [
        ({"type": "url", "url": "https://e.com/a.png", "data": "iVBO"}, "source.data"),
        ({"type": "base64", "media_type": "image/png", "data": "iVBO", "url": "x"}, "source.url"),
    ]
    for source, field in mixed:
        content = [{"type": "image", "source": source}]
        error = refused(messages=[{"role": "user", "content": content}])
        assert error.param == f"messages[0].content[0].{field}"


def test_bad_text_blocks_are_named() -> None:
    bad = [{"role": "user", "content": [{"type": "text", "text": "a", "colour": "red"}]}]
    error = refused(messages=bad)
    assert error.param == "messages[0].content[0].colour"
    error = refused(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}])
    assert error.param == "messages[0].content[0].text"
    assert "messages[0].content[0].text" in error.message
    error = refused(messages=[{"role": "user", "content": [{"text": "no type"}]}])
    assert error.param == "messages[0].content[0].type"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": 1.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"metadata": {"user_id": "u", "session": "s"}}, "metadata.session"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages"),  # nothing to answer
        ({"system": [{"type": "image", "source": {}}]}, "system"),
        ({"stop_sequences": ["s"] * 17}, "stop_sequences"),  # checked at every token
        ({"stop_sequences": ["s" * 1025]}, "stop_sequences"),
    ],
)
def test_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    error = refused(**fields)
    assert error.param is not None and error.param.startswith(param), error.param


@pytest.mark.parametrize("field", ["speed", "container", "mcp_servers", "n", "logprobs"])
def test_unknown_fields_are_named(field: str) -> None:
    error = refused(**{field: 1})
    assert error.param == field
    assert f"`{field}`" in error.message


def test_max_tokens_is_required() -> None:
    body = {"model": "m", "messages": USER}
    with pytest.raises(GatewayError) as info:
        decode_body(enc(body), MessagesRequest)
    assert "max_tokens" in info.value.message


def test_count_tokens_checks_tools_and_refuses_generation_fields() -> None:
    for extra, param in (
        ({"tools": [{"name": "f"}]}, "tools[0]"),
        ({"max_tokens": 5}, "max_tokens"),
    ):
        body = {"model": "m", "messages": USER, **extra}
        with pytest.raises(GatewayError) as info:
            prompt_request(decode_body(enc(body), CountTokensRequest))
        assert info.value.param == param


# ---- responses ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "stop", "expected"),
    [
        (FinishReason.STOP, None, ("end_turn", None)),
        (FinishReason.STOP, "END", ("stop_sequence", "END")),
        (FinishReason.LENGTH, None, ("max_tokens", None)),
        (None, None, (None, None)),
    ],
)
def test_stop_reason(
    reason: FinishReason | None, stop: str | None, expected: tuple[str | None, str | None]
) -> None:
    assert stop_reason(reason, stop) == expected


def test_response_body() -> None:
    fmt = MessagesFormatter("chat-alias")
    choice = Choice(0, pieces=["Hello"], finish_reason=FinishReason.STOP, stop="END")
    body = json.loads(fmt.response([choice], Usage(11, 3, cached_tokens=8)))
    assert body == {
        "id": fmt.id,
        "type": "message",
        "role": "assistant",
        "model": "chat-alias",
        "content": [{"type": "text", "text": "Hello"}],
        "stop_reason": "stop_sequence",
        "stop_sequence": "END",
        # Anthropic's split: input_tokens leaves out what was read from the cache
        "usage": {
            "input_tokens": 3,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 8,
            "output_tokens": 3,
        },
    }
    assert fmt.id.startswith("msg_") and len(fmt.id) == 36
    assert MessagesFormatter("m").id != fmt.id


def test_stream_event_sequence() -> None:
    fmt = MessagesFormatter("m")
    first = RequestOutput("r", "Hel", [1], usage=Usage(17, 1, cached_tokens=12))
    out = fmt.stream_start(first)
    out += fmt.stream_delta(0, first)
    out += fmt.stream_delta(0, RequestOutput("r", "", [2]))  # held back: nothing
    out += fmt.stream_delta(0, RequestOutput("r", "lo", [3]))
    last = RequestOutput("r", "", [4], FinishReason.LENGTH, Usage(17, 4, cached_tokens=12))
    out += fmt.stream_delta(0, last) + fmt.stream_finish(0, last) + fmt.stream_end(Usage(17, 4))
    events = _parse(out)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start == {
        "id": fmt.id,
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": 5,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 12,
            "output_tokens": 1,
        },
    }
    assert events[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert [e[1]["delta"] for e in events[3:5]] == [
        {"type": "text_delta", "text": "Hel"},
        {"type": "text_delta", "text": "lo"},
    ]
    assert events[5][1] == {"type": "content_block_stop", "index": 0}
    assert events[6][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {
            "output_tokens": 4,
            "input_tokens": 5,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 12,
        },
    }


def finish_events(fmt: MessagesFormatter, done: RequestOutput) -> list[dict[str, Any]]:
    """The events of a stream that ends with `done` after its start."""
    fmt.stream_start(RequestOutput("r", usage=done.usage))
    return [data for _, data in _parse(fmt.stream_finish(0, done))]


def test_stream_stop_sequence_and_error_event() -> None:
    fmt = MessagesFormatter("m")
    done = RequestOutput("r", "", [], FinishReason.STOP, Usage(5, 2), stop="\n\n")
    stop_event, delta = finish_events(fmt, done)
    assert stop_event["type"] == "content_block_stop"
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "\n\n"}
    error = GatewayError(ErrorCode.WORKER_DIED, "the worker died")
    [(name, body)] = _parse(fmt.stream_error(error))
    assert name == "error"
    assert body["type"] == "error"
    assert body["error"]["message"] == "the worker died"
    assert body["error"]["type"] == "api_error"


def test_usage_parses_in_the_anthropic_sdk() -> None:
    """The SDK's models read the split; a stream's snapshot keeps it through message_delta."""
    from anthropic.types import Message as SdkMessage
    from anthropic.types import MessageDeltaUsage

    fmt = MessagesFormatter("m")
    choice = Choice(0, pieces=["x"], finish_reason=FinishReason.STOP)
    usage = SdkMessage.model_validate(json.loads(fmt.response([choice], Usage(9, 1, 9)))).usage
    assert (usage.input_tokens, usage.cache_read_input_tokens) == (0, 9)
    assert usage.cache_creation_input_tokens == 0
    done = RequestOutput("r", "", [], FinishReason.STOP, Usage(9, 1, 4))
    delta = finish_events(fmt, done)[1]
    parsed = MessageDeltaUsage.model_validate(delta["usage"])
    assert (parsed.input_tokens, parsed.cache_read_input_tokens) == (5, 4)


def test_a_finish_without_usage_sends_no_input_split() -> None:
    done = RequestOutput("r", "", [], FinishReason.STOP)
    delta = finish_events(MessagesFormatter("m"), done)[1]
    assert delta["usage"] == {"output_tokens": 0}
