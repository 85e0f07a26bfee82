"""End to end through the official openai SDK, a real gateway and real worker processes."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.gateway_proc import GatewayProc

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def test_models_lists_configured_models(client: openai.OpenAI) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"chat", "other", "bytes"}
    extra = models["chat"].model_extra or {}
    assert extra["state"] == "ready"
    assert extra["aliases"] == ["chat-alias"]


def test_chat_non_stream(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=12)
    choice = r.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert choice.message.role == "assistant"
    assert r.usage is not None
    assert r.usage.prompt_tokens > 5
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    details = r.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert 0 <= details.cached_tokens <= r.usage.prompt_tokens


def test_chat_alias_routes_to_model(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="chat-alias", messages=MESSAGES, max_tokens=3)
    assert r.model == "chat-alias"
    assert r.usage is not None and r.usage.completion_tokens >= 1


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="chat",
        messages=MESSAGES,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 16
    details = usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert 0 <= details.cached_tokens <= usage.prompt_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text  # printable vocabulary: a random model still says something visible


def test_completions_non_stream_and_stream(client: openai.OpenAI) -> None:
    r = client.completions.create(model="chat", prompt="Once upon a time", max_tokens=8)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage is not None and r.usage.completion_tokens <= 8
    chunks = list(
        client.completions.create(
            model="chat",
            prompt="Once upon a time",
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    greedy = client.completions.create(
        model="chat",
        prompt="Once upon a time",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    again = client.completions.create(
        model="chat",
        prompt="Once upon a time",
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert greedy.choices[0].text == "".join(c.choices[0].text for c in again if c.choices)
    assert isinstance(streamed, str)


def test_completion_prompt_token_ids(client: openai.OpenAI) -> None:
    r = client.completions.create(model="chat", prompt=[5, 6, 7, 8], max_tokens=4)
    assert r.usage is not None and r.usage.prompt_tokens == 4
    assert r.usage.prompt_tokens_details is not None
    assert 0 <= (r.usage.prompt_tokens_details.cached_tokens or 0) <= 4


def test_two_models_two_workers(client: openai.OpenAI, gateway: GatewayProc) -> None:
    a = client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=4)
    b = client.chat.completions.create(model="other", messages=MESSAGES, max_tokens=4)
    assert a.usage and b.usage
    ps = gateway.ps()
    assert ps["chat"]["state"] == ps["other"]["state"] == "ready"
    assert ps["chat"]["pid"] != ps["other"]["pid"]
    assert ps["chat"]["rss_bytes"] > 10 * 2**20


@pytest.mark.anyio
async def test_32_concurrent_streams(gateway: GatewayProc) -> None:
    aclient = openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0)

    async def one(i: int) -> tuple[int, str]:
        stream = await aclient.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": f"request {i}: write a story"}],
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage, finish = None, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert usage is not None and finish is not None
        return usage.completion_tokens, finish

    # Closed here, on this test's loop: left to the garbage collector, its connections would
    # be closed later on another test's loop (which then fails with "Event loop is closed").
    async with aclient:
        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), 120)
    assert results == [(24, "length")] * 32


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client: openai.OpenAI, stream: bool) -> None:
    base = (
        client.completions.create(
            model="chat",
            prompt="abc",
            max_tokens=30,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    assert len(base) > 6
    stop = base[3:6]
    index = base.find(stop)
    kwargs = {"model": "chat", "prompt": "abc", "max_tokens": 30, "temperature": 0, "stop": stop}
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        r = client.completions.create(**kwargs)  # type: ignore[call-overload]
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert text == base[:index]
    assert finish == "stop"
