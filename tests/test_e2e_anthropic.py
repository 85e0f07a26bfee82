"""End to end through the official anthropic SDK (and raw httpx for the SSE wire format), a
real gateway and real worker processes: the Anthropic Messages API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.gateway_proc import GatewayProc, running_gateway

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"temperature": 0}
# The "bytes" model's greedy chain (tests/conftest.py bytes_spec): after 'x' comes y, z, x, ...
# A prefill "x" makes the prompt end there.
XYZ: list[Any] = [
    {"role": "user", "content": "Count."},
    {"role": "assistant", "content": "x"},
]


@pytest.fixture(scope="module")
def claude(gateway: GatewayProc) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.base_url, api_key="unused", max_retries=0)


def sse_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """Named SSE events, checked for Anthropic's framing (event line, data line, blank)."""
    events = []
    for block in response.read().decode().split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        assert len(lines) == 2, block
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        events.append((lines[0][7:], json.loads(lines[1][6:])))
    return events


def text_of(message: anthropic.types.Message) -> str:
    """The message's one text block."""
    [block] = message.content
    assert block.type == "text"
    return block.text


def prompt_of(usage: anthropic.types.Usage | anthropic.types.MessageDeltaUsage) -> int:
    """The whole prompt: Anthropic's input_tokens leaves out what the prefix cache served."""
    parts = (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens)
    return sum(part or 0 for part in parts)


def count(claude: anthropic.Anthropic, **fields: Any) -> int:
    return claude.messages.count_tokens(**{"model": "chat", **fields}).input_tokens


# ---- generation ---------------------------------------------------------------------------


def test_non_stream_and_stream_agree(claude: anthropic.Anthropic) -> None:
    r = claude.messages.create(model="chat", messages=MESSAGES, max_tokens=12, extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.model == "chat"
    assert r.id.startswith("msg_")
    assert [block.type for block in r.content] == ["text"]
    assert r.stop_reason in ("max_tokens", "end_turn")
    assert r.stop_sequence is None
    assert prompt_of(r.usage) > 5
    assert r.usage.cache_read_input_tokens is not None and r.usage.cache_read_input_tokens >= 0
    assert r.usage.cache_creation_input_tokens == 0
    assert 1 <= r.usage.output_tokens <= 12
    assert r._request_id  # the request-id header
    text = text_of(r)
    assert text

    events = list(
        claude.messages.create(
            model="chat", messages=MESSAGES, max_tokens=12, stream=True, extra_body=GREEDY
        )
    )
    streamed = "".join(
        e.delta.text
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "text_delta"
    )
    assert streamed == text
    start = next(e for e in events if e.type == "message_start")
    assert prompt_of(start.message.usage) == prompt_of(r.usage)  # the cache may differ
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.usage.output_tokens == r.usage.output_tokens
    assert prompt_of(delta.usage) == prompt_of(r.usage)
    assert delta.delta.stop_reason == r.stop_reason


def test_raw_event_sequence(gateway: GatewayProc, claude: anthropic.Anthropic) -> None:
    body = {"model": "chat", "messages": MESSAGES, "max_tokens": 6, "stream": True, **GREEDY}
    headers = {"x-api-key": "unused", "anthropic-version": "2023-06-01"}
    with httpx.stream(
        "POST", f"{gateway.base_url}/v1/messages", json=body, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas >= 1
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    message = events[0][1]["message"]
    assert message["id"].startswith("msg_") and message["model"] == "chat"
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"] == [] and message["stop_reason"] is None
    usage = message["usage"]
    assert usage["cache_creation_input_tokens"] == 0
    prompt = count(claude, messages=MESSAGES)
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt
    assert message["usage"]["output_tokens"] in (0, 1)
    assert events[1][1]["index"] == 0
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    for _, data in events[3 : 3 + deltas]:
        assert data["index"] == 0 and data["delta"]["type"] == "text_delta"
        assert data["delta"]["text"]
    final = events[-2][1]
    assert final["delta"]["stop_reason"] in ("max_tokens", "end_turn")
    assert 1 <= final["usage"]["output_tokens"] <= 6
    r2 = claude.messages.create(model="chat", messages=MESSAGES, max_tokens=6, extra_body=GREEDY)
    assert "".join(d["delta"]["text"] for _, d in events[3 : 3 + deltas]) == text_of(r2)


def test_stream_helper_yields_the_final_message(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model="chat", messages=MESSAGES, max_tokens=8, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text_of(final) == text
    r = claude.messages.create(model="chat", messages=MESSAGES, max_tokens=8, extra_body=GREEDY)
    assert text_of(r) == text
    assert prompt_of(final.usage) == prompt_of(r.usage)
    assert final.usage.output_tokens == r.usage.output_tokens
    assert final.stop_reason == r.stop_reason


def test_prefill_continues_the_assistant_message(claude: anthropic.Anthropic) -> None:
    r = claude.messages.create(model="bytes", messages=XYZ, max_tokens=5, extra_body=GREEDY)
    assert text_of(r) == "yzxyz"  # the continuation only
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    assert r.usage.output_tokens == 5


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(claude: anthropic.Anthropic, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": "bytes",
        "messages": XYZ,
        "max_tokens": 12,
        "stop_sequences": ["never", "zx"],
        "extra_body": GREEDY,
    }
    if stream:
        with claude.messages.stream(**kwargs) as s:
            text = "".join(s.text_stream)
            r = s.get_final_message()
        assert text_of(r) == text
    else:
        r = claude.messages.create(**kwargs)
    # "zx" spans two tokens: only "y" is shown.
    assert text_of(r) == "y"
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "zx"
    assert r.usage.output_tokens == 3


def test_max_tokens_stop_reason(claude: anthropic.Anthropic) -> None:
    events = list(
        claude.messages.create(
            model="bytes", messages=XYZ, max_tokens=2, stream=True, extra_body=GREEDY
        )
    )
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 2


def test_system_prompt_string_and_blocks(claude: anthropic.Anthropic) -> None:
    plain = count(claude, messages=MESSAGES)
    as_string = count(claude, messages=MESSAGES, system="Answer in one word.")
    blocks: Any = [
        {"type": "text", "text": "Answer in "},
        {"type": "text", "text": "one word.", "cache_control": {"type": "ephemeral"}},
    ]
    assert as_string > plain
    assert count(claude, messages=MESSAGES, system=blocks) == as_string
    r = claude.messages.create(
        model="chat", messages=MESSAGES, system=blocks, max_tokens=2, extra_body=GREEDY
    )
    assert prompt_of(r.usage) == as_string


def test_multi_turn_and_count_tokens(claude: anthropic.Anthropic) -> None:
    turns: Any = [
        *MESSAGES,
        {"role": "assistant", "content": [{"type": "text", "text": "It is wide."}]},
        {"role": "user", "content": [{"type": "text", "text": "And deep?"}]},
    ]
    n = count(claude, messages=turns)
    assert n > count(claude, messages=MESSAGES)
    r = claude.messages.create(model="chat", messages=turns, max_tokens=3, extra_body=GREEDY)
    assert prompt_of(r.usage) == n
    # A prefill's prompt is counted the same way.
    prefill: Any = [*MESSAGES, {"role": "assistant", "content": "The sea"}]
    r = claude.messages.create(model="chat", messages=prefill, max_tokens=2, extra_body=GREEDY)
    assert prompt_of(r.usage) == count(claude, messages=prefill)


def test_accepted_fields_and_headers(gateway: GatewayProc) -> None:
    beta = anthropic.Anthropic(
        base_url=gateway.base_url,
        api_key="unused",
        max_retries=0,
        default_headers={"anthropic-beta": "prompt-caching-2024-07-31", "anthropic-version": "x"},
    )
    r = beta.messages.create(
        model="chat-alias",
        messages=MESSAGES,
        max_tokens=2,
        metadata={"user_id": "u-123"},
        service_tier="standard_only",
        tools=[],
        thinking={"type": "disabled"},
        cache_control={"type": "ephemeral"},  # automatic caching's request-level breakpoint
        extra_body={"top_p": 0.9, "top_k": 20, "temperature": 0.5},
    )
    assert r.model == "chat-alias" and r.usage.output_tokens >= 1


def test_claude_code_s_requests_are_served(claude: anthropic.Anthropic) -> None:
    # what Claude Code sends with every request, to a model with no thinking (the session's
    # "chat"): adaptive thinking, context editing, its billing block (whose checksum changes
    # every request, and which must not end the prefix the turns share), a system message
    # in the conversation; its 32000 max_tokens, past the 2048-token context, is refused in
    # the words it reads to retry with fewer
    system: list[Any] = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=0a1b2;"},
        {"type": "text", "text": "You are a helpful assistant. " * 40},
    ]
    fields: dict[str, Any] = {
        "model": "chat",
        "system": system,
        "thinking": {"type": "adaptive"},
        "extra_body": {
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
        },
    }
    messages: list[Any] = [
        {"role": "user", "content": "Tell me about the sea."},
        {"role": "system", "content": "Agents: explore."},  # a system message (2.1.154+)
    ]
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(messages=messages, max_tokens=32000, stream=True, **fields)
    assert "input length and `max_tokens` exceed context limit: " in str(info.value)
    first = claude.messages.create(messages=messages, max_tokens=2, **fields)
    assert first.content[0].type == "text"  # answered without thinking
    system[0]["text"] = "x-anthropic-billing-header: cc_version=2; cch=9f8e7;"
    again = claude.messages.create(messages=messages, max_tokens=2, **fields)
    assert again.usage.cache_read_input_tokens >= 100  # the shared prefix, its system included


# ---- errors -------------------------------------------------------------------------------


def _bad(claude: anthropic.Anthropic, **fields: Any) -> dict[str, Any]:
    kwargs = {"model": "chat", "messages": MESSAGES, "max_tokens": 4, **fields}
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(**kwargs)
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"speed": "fast"}, "speed"),
        ({"extra_body": {"logprobs": True}}, "logprobs"),
        # the chat model's template renders no tools and has no thinking
        ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tool"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [{"type": "web_search_20250305", "name": "w"}]}, "tools[0].type"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2}}, "thinking"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),
        ({"extra_body": {"max_tokens": "8"}}, "max_tokens"),
        ({"extra_body": {"temperature": -1}}, "temperature"),
        ({"messages": []}, "messages"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {"type": "image", "source": {"type": "url", "url": "http://x/y"}},
                        ],
                    }
                ]
            },
            "it takes no images",  # a text model: refused before the URL is fetched
        ),
    ],
)
def test_unsupported_fields_are_named(
    claude: anthropic.Anthropic, fields: dict[str, Any], named: str
) -> None:
    error = _bad(claude, **fields)
    assert named in error["message"]


def test_unknown_model_is_not_found(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error" and "no-such-model" in str(body)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="no-such-model", messages=MESSAGES)


def test_count_tokens_counts_tools_where_the_template_renders_them(
    claude: anthropic.Anthropic,
) -> None:
    """The chat model's template has no tools: counting a prompt with tools says so."""
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.count_tokens(
            model="chat",
            messages=MESSAGES,
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
        )
    assert "tool" in str(info.value.body)


def test_error_before_the_first_byte_is_a_plain_http_error(claude: anthropic.Anthropic) -> None:
    # "other" has a 256-token context: the worker refuses before any token.
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model="other", messages=MESSAGES, max_tokens=5000, stream=True)
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert "exceed context limit" in body["error"]["message"]


# ---- a failure mid-stream -------------------------------------------------------------------


@pytest.fixture(scope="module")
def crashing_gateway(chat_model: Path) -> Iterator[GatewayProc]:
    """A worker that dies right after the first token of a prompt containing CRASH; the
    first death ends the stream (resume_max = 0: going on from its tokens on the next
    worker, which the prompt kills too, is tests/test_e2e_faults.py's)."""
    models = [{"name": "fragile", "source": str(chat_model)}]
    faults = {"MLX_GATEWAY_FAULTS": json.dumps({"fragile": {"crash_on": "CRASH"}})}
    server = {"request_timeout_s": 60.0, "restart_backoff_s": 0.2, "resume_max": 0}
    with running_gateway(models, faults, **server) as gw:
        yield gw


def test_failure_mid_stream_is_an_error_event(crashing_gateway: GatewayProc) -> None:
    crash: Any = [{"role": "user", "content": "CRASH please"}]
    body = {
        "model": "fragile",
        "messages": crash,
        "max_tokens": 50,
        "stream": True,
    }
    url = f"{crashing_gateway.base_url}/v1/messages"
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(r)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-1] == "error" and "message_stop" not in names
    error = events[-1][1]
    assert error["type"] == "error"
    assert "died" in error["error"]["message"]
    assert error["error"]["type"] == "api_error"

    # Through the SDK the same failure is an APIError raised while iterating.
    claude = anthropic.Anthropic(base_url=crashing_gateway.base_url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.APIError) as info:
        for _ in claude.messages.create(
            model="fragile", messages=crash, max_tokens=50, stream=True
        ):
            pass
    assert "died" in str(info.value)
