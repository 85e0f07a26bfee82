"""The neutral message model as each protocol's translator fills it: images (bytes or URL,
each with the path of the field the client put it in), audio, an assistant's tool calls and
reasoning, tool results. Each is mapped and recorded in Unserved; what no worker serves yet
(audio) is refused with a 400 naming the protocol's own field, the rest passes (images then
meet the capability check: a text model refuses them)."""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import pytest

from gateway.api.anthropic.schemas import MessageParam
from gateway.api.anthropic.translate import _messages
from gateway.api.common import Unserved, image_from_url
from gateway.api.openai.messages import message_of
from gateway.api.openai.schemas import ChatMessage
from gateway.api.responses.schemas import InputImage, InputText, MessageItem
from gateway.api.responses.translate import input_items, item_message, messages_of
from gateway.errors import GatewayError
from shared.types import (
    AudioPart,
    CanonicalRequest,
    ErrorCode,
    ImagePart,
    Message,
    TextPart,
    ToolCall,
)

PNG = b"\x89PNG\r\n\x1a\n"
PNG64 = base64.b64encode(PNG).decode()


def test_a_data_url_is_decoded_and_an_http_url_kept_for_fetching() -> None:
    assert image_from_url(f"data:image/png;base64,{PNG64}", "x") == ImagePart(
        PNG, "image/png", where="x"
    )
    assert image_from_url("https://e.com/a.jpg", "x", "low") == ImagePart(
        url="https://e.com/a.jpg", detail="low", where="x"
    )
    for bad in ("file:///etc/passwd", "data:image/png;base64,@@@", "ftp://e.com/a"):
        with pytest.raises(GatewayError) as err:
            image_from_url(bad, "messages[0].content[1].image_url.url")
        assert err.value.param == "messages[0].content[1].image_url.url"


def test_unserved_refuses_the_first_use_not_served() -> None:
    unserved = Unserved()
    unserved.refuse()  # nothing used: nothing refused
    unserved.add("tool_calls", _err("a"))
    unserved.add("image", _err("b"))
    with pytest.raises(GatewayError, match="b"):
        unserved.refuse({"tool_calls"})
    unserved.refuse({"tool_calls", "image"})
    assert unserved.features == ["tool_calls", "image"]


def _err(message: str) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST, message)


def _openai(raw: dict[str, Any]) -> tuple[Message, Unserved]:
    unserved = Unserved()
    return message_of(2, msgspec.convert(raw, ChatMessage), unserved), unserved


def test_openai_content_parts_map_in_order() -> None:
    message, unserved = _openai(
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is "},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG64}"}},
                {"type": "text", "text": "this?"},
                {"type": "input_audio", "input_audio": {"data": PNG64, "format": "wav"}},
            ],
        }
    )
    assert message.content == "What is this?"
    assert message.parts == [
        TextPart("What is "),
        ImagePart(PNG, "image/png", where="messages[2].content[1].image_url.url"),
        TextPart("this?"),
        AudioPart(PNG, "wav"),
    ]
    assert unserved.features == ["image", "audio"]
    with pytest.raises(GatewayError) as err:
        unserved.refuse()  # the image is served, the audio is not
    assert err.value.param == "messages[2].content[3]"


def test_openai_text_parts_alone_stay_plain_text() -> None:
    message, unserved = _openai({"role": "user", "content": [{"type": "text", "text": "hi"}]})
    assert message == Message("user", "hi") and unserved.features == []


def test_openai_tool_calls_results_and_reasoning_map() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assistant, unserved = _openai(
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "hm"}
    )
    assert assistant.tool_calls == [ToolCall("call_1", "f", "{}")]
    assert assistant.reasoning == "hm"
    assert unserved.features == ["tool_calls", "reasoning"]
    unserved.refuse()  # served
    tool, unserved = _openai({"role": "tool", "content": "12C", "tool_call_id": "call_1"})
    assert tool == Message("tool", "12C", tool_call_id="call_1")
    assert unserved.features == ["tool_result"]
    unserved.refuse()


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"role": "tool", "content": "x"}, "messages[2].tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[2].tool_call_id"),
        (
            {"role": "user", "content": "x", "reasoning_content": "r"},
            "messages[2].reasoning_content",
        ),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x:y"}}]},
            "messages[2].content[0].image_url.url",
        ),
        ({"role": "user", "content": [{"type": "file", "file": {}}]}, "messages[2].content[0]"),
        ({"role": "assistant", "content": "x", "audio": {"id": "a"}}, "messages[2].audio"),
        (
            {"role": "assistant", "content": "x", "function_call": {"name": "f"}},
            "messages[2].function_call",
        ),
        ({"role": "assistant", "content": "x", "annotations": [{}]}, "messages[2].annotations"),
        ({"role": "user", "content": "x", "function_call": {}}, "messages[2].function_call"),
    ],
)
def test_openai_malformed_messages_are_named(raw: dict[str, Any], param: str) -> None:
    with pytest.raises(GatewayError) as err:
        _openai(raw)
    assert err.value.param == param


def test_an_assistant_message_as_the_sdk_returns_it_goes_back_as_it_is() -> None:
    """`message.model_dump()`: its fields the SDK fills with nulls are no use of them."""
    dumped = {"role": "assistant", "content": "Hi.", "refusal": None, "annotations": None}
    dumped |= {"audio": None, "function_call": None, "tool_calls": None}
    message, _ = _openai(dumped)
    assert (message.role, message.content) == ("assistant", "Hi.")
    assert _openai({**dumped, "annotations": []})[0] == message


def _anthropic(raw: dict[str, Any]) -> tuple[list[Message], Unserved]:
    unserved = Unserved()
    return _messages(1, msgspec.convert(raw, MessageParam), unserved), unserved


def test_anthropic_blocks_map_and_tool_results_become_tool_messages() -> None:
    messages, unserved = _anthropic(
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "t2",
                    "content": [{"type": "text", "text": "rain"}],
                    "is_error": True,  # the model reads it: templates have no flag for it
                },
                {"type": "text", "text": "And "},
                {"type": "image", "source": {"type": "url", "url": "https://e.com/a.png"}},
            ],
        }
    )
    assert messages == [
        Message("tool", "sunny", tool_call_id="t1"),
        Message("tool", "Error: rain", tool_call_id="t2"),
        Message(
            "user",
            "And ",
            parts=[
                TextPart("And "),
                ImagePart(url="https://e.com/a.png", where="messages[1].content[3].source"),
            ],
        ),
    ]
    assert unserved.features == ["tool_result", "tool_result", "image"]
    unserved.refuse()  # all served


def test_anthropic_assistant_tool_use_and_thinking_map() -> None:
    messages, unserved = _anthropic(
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}},
            ],
        }
    )
    assert messages == [
        Message(
            "assistant",
            "Checking.",
            tool_calls=[ToolCall("t1", "weather", '{"city": "Oslo"}')],
            reasoning="Look it up.",
        )
    ]
    assert unserved.features == ["reasoning", "tool_calls"]


def test_anthropic_base64_images_are_decoded() -> None:
    source = {"type": "base64", "media_type": "image/png", "data": PNG64}
    content = [{"type": "text", "text": "see"}, {"type": "image", "source": source}]
    messages, _ = _anthropic({"role": "user", "content": content})
    image = ImagePart(PNG, "image/png", where="messages[1].content[1].source")
    assert messages[0].parts == [TextPart("see"), image]
    result = {"type": "tool_result", "tool_use_id": "t", "content": content}
    messages, _ = _anthropic({"role": "user", "content": [result]})
    image = ImagePart(PNG, "image/png", where="messages[1].content[0].content[1].source")
    assert messages[0].parts == [TextPart("see"), image]


def test_responses_items_map() -> None:
    unserved = Unserved()
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'}
    assert item_message(call, "input[0]", unserved) == Message(
        "assistant", tool_calls=[ToolCall("c1", "f", '{"a": 1}')]
    )
    output = {"type": "function_call_output", "call_id": "c1", "output": "2"}
    assert item_message(output, "input[1]", unserved) == Message("tool", "2", tool_call_id="c1")
    reasoning = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "why"}]}
    assert item_message(reasoning, "input[2]", unserved) == Message("assistant", reasoning="why")
    assert unserved.features == ["tool_calls", "tool_result", "reasoning"]


def test_responses_images_are_kept_in_the_item_and_named_by_their_part() -> None:
    unserved = Unserved()
    url = f"data:image/png;base64,{PNG64}"
    content = [
        {"type": "input_text", "text": "what is"},
        {"type": "input_image", "image_url": url},
        {"type": "input_image", "image_url": "https://e.com/a.png", "detail": "low"},
    ]
    raw: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "user", "content": content},
    ]
    items = input_items(raw, unserved)
    assert isinstance(items[1], MessageItem)
    assert items[1].content == [
        InputText("what is"),
        InputImage(url),
        InputImage("https://e.com/a.png", "low"),
    ]
    assert unserved.features == ["image", "image"]
    unserved.refuse()  # served
    own = messages_of(items, None)
    assert own[1] == Message(
        "user",
        "what is",
        parts=[
            TextPart("what is"),
            ImagePart(PNG, "image/png", detail="auto", where="input[1].content[1].image_url"),
            ImagePart(
                url="https://e.com/a.png", detail="low", where="input[1].content[2].image_url"
            ),
        ],
    )
    # chained: the earlier response's images are named by `previous_response_id`
    chained = messages_of([*items, *input_items("next")], None, history=2)
    assert [part.where for part in chained[1].parts if isinstance(part, ImagePart)] == [
        "previous_response_id",
        "previous_response_id",
    ]
    with pytest.raises(GatewayError) as err:
        input_items([{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}])
    assert err.value.param == "input[0].content[0].file_id"


def test_images_and_audio_are_capabilities_a_request_needs() -> None:
    """What the gateway checks against a model (a text-only model: a 400 naming `messages`,
    before anything loads), once workers serve them."""
    image = Message("user", "look", parts=[TextPart("look"), ImagePart(PNG, "image/png")])
    audio = Message("user", "", parts=[AudioPart(b"RIFF", format="wav")])
    assert CanonicalRequest(messages=[image]).needs() == ["vision"]
    assert CanonicalRequest(messages=[image, audio]).needs() == ["vision", "audio_input"]
    assert CanonicalRequest(messages=[Message("user", "hi")]).needs() == []
