"""Prompt reuse through real processes and the official SDKs: cached tokens reported in each
protocol, each turn of a conversation reusing the last, the same greedy tokens as without
the cache, and a cache that stays within its bound."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine_fixtures import Loaded, drive, greedy
from tests.gateway_proc import GatewayProc, openai_client, running_gateway, wait_for

SYSTEM = (
    "You are the on-call assistant of a small team that runs a local model server. Read the "
    "incident notes, keep answers short, and say which note each claim comes from."
)
TURNS = ["What failed first?", "Why did it fail?", "What did we change?", "Is it fixed?"]


@pytest.fixture(scope="module")
def entry_bytes(chat: Loaded) -> int:
    """What one finished request of about this size leaves in the cache."""
    engine = chat.engine()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    prompt = list(chat.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    drive(engine, [greedy("probe", prompt, 8, ignore_eos=True)])
    stats = engine.prefix_stats()
    assert stats is not None and stats.entries == 1
    return stats.nbytes


@pytest.fixture(scope="module")
def gw(chat_model: Path, entry_bytes: int) -> Iterator[GatewayProc]:
    models = [
        {"name": "cached", "source": str(chat_model)},
        {"name": "uncached", "source": str(chat_model), "engine": {"prefix_cache": False}},
        # the project's own continuous batch in place of mlx-lm's BatchGenerator
        {"name": "rows", "source": str(chat_model), "engine": {"batcher": "rows"}},
        # room for about three entries of this test's size
        {
            "name": "small",
            "source": str(chat_model),
            "engine": {"prefix_cache_gb": 3.5 * entry_bytes / 2**30},
        },
        # room for none: every request's KV is larger than the whole bound
        {
            "name": "tiny",
            "source": str(chat_model),
            "engine": {"prefix_cache_gb": 0.5 * entry_bytes / 2**30},
        },
    ]
    with running_gateway(models, request_timeout_s=60.0) as gateway:
        yield gateway


def ask(client: openai.OpenAI, model: str, messages: list[dict[str, str]], n: int = 10) -> Any:
    return client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=n,
        temperature=0,  # type: ignore[arg-type]
    )


def cached_tokens(response: Any) -> int:
    details = response.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


def test_the_same_long_prompt_twice(gw: GatewayProc) -> None:
    client = openai_client(gw)
    messages = [{"role": "system", "content": f"One. {SYSTEM}"}, {"role": "user", "content": "Hi."}]
    first, second = ask(client, "cached", messages), ask(client, "cached", messages)
    assert cached_tokens(first) == 0
    assert cached_tokens(second) == second.usage.prompt_tokens - 1
    assert second.choices[0].message.content == first.choices[0].message.content
    # streamed: the include_usage chunk says it too
    stream = client.chat.completions.create(
        model="cached",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage and usage[-1].prompt_tokens_details is not None
    assert usage[-1].prompt_tokens_details.cached_tokens == usage[-1].prompt_tokens - 1


def test_a_four_turn_conversation_reuses_each_turn_token_for_token(gw: GatewayProc) -> None:
    client = openai_client(gw)
    answers: dict[str, list[str]] = {}
    for model in ("cached", "uncached", "rows"):
        messages = [{"role": "system", "content": f"Two. {SYSTEM}"}]
        answers[model] = []
        previous_prompt = 0
        for turn, question in enumerate(TURNS):
            messages.append({"role": "user", "content": question})
            reply = ask(client, model, messages, n=12)
            text = reply.choices[0].message.content or ""
            answers[model].append(text)
            messages.append({"role": "assistant", "content": text})
            if model == "uncached" or turn == 0:
                assert cached_tokens(reply) == 0
            else:
                assert cached_tokens(reply) >= previous_prompt, f"turn {turn}"
            previous_prompt = reply.usage.prompt_tokens
    assert answers["cached"] == answers["uncached"] == answers["rows"]

    def memo_hits() -> float:  # each turn's earlier messages: segments found in the worker's memo
        text = httpx.get(f"{gw.base_url}/metrics", timeout=10).text
        return sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "mlxgw_prompt_segments_hits_total" and s.labels == {"model": "cached"}
        )

    wait_for(lambda: memo_hits() > 0, what="prompt-segment hits in a heartbeat")


def test_anthropic_reports_cache_reads_and_accepts_cache_control(gw: GatewayProc) -> None:
    client = anthropic.Anthropic(base_url=gw.base_url, api_key="x", max_retries=0)
    system = [{"type": "text", "text": f"Three. {SYSTEM}", "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": "Which note is the oldest?"}]
    replies = [
        client.messages.create(
            model="cached",
            max_tokens=8,
            system=system,  # type: ignore[arg-type]
            messages=messages,  # type: ignore[arg-type]
            extra_body={"temperature": 0},
        )
        for _ in range(2)
    ]
    first, second = (r.usage for r in replies)
    assert first.cache_read_input_tokens == 0
    whole = first.input_tokens
    assert second.cache_read_input_tokens == whole - 1
    assert second.input_tokens == 1  # the part that was not read from the cache
    assert second.cache_creation_input_tokens == 0


def test_responses_reports_cached_input_tokens(gw: GatewayProc) -> None:
    client = openai_client(gw)
    kwargs: dict[str, Any] = {
        "model": "cached",
        "instructions": f"Four. {SYSTEM}",
        "max_output_tokens": 8,
    }
    first = client.responses.create(input="Name the first note.", **kwargs)
    second = client.responses.create(input="Name the first note.", **kwargs)
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens == second.usage.input_tokens - 1


def test_a_cache_that_does_not_fit_is_evicted_not_grown(gw: GatewayProc) -> None:
    client = openai_client(gw)
    for i in range(6):
        messages = [
            {"role": "system", "content": f"{i}: {SYSTEM}"},
            {"role": "user", "content": TURNS[0]},
        ]
        ask(client, "small", messages, n=8)

    def evicted() -> bool:
        stats = gw.ps()["small"]["prefix_cache"]
        return stats is not None and stats["lookups"] >= 6 and stats["evictions"] >= 3

    wait_for(evicted, what="the sixth request in a heartbeat")  # heartbeats come every second
    stats = gw.ps()["small"]["prefix_cache"]
    assert stats["nbytes"] <= stats["capacity_bytes"]
    assert 1 <= stats["entries"] <= 3
    assert gw.ps()["uncached"]["prefix_cache"] is None


def test_the_default_bound_follows_the_device(gw: GatewayProc) -> None:
    """No prefix_cache_gb: an eighth of the device's memory (this CPU worker's: host RAM), at
    least 2 GiB, as the worker reports it."""

    def reported() -> bool:
        return gw.ps()["cached"]["prefix_cache"] is not None

    wait_for(reported, what="the cached model's first heartbeat")
    expected = max(2 * 2**30, psutil.virtual_memory().total // 8)
    assert gw.ps()["cached"]["prefix_cache"]["capacity_bytes"] == expected


def test_a_kv_larger_than_the_bound_is_counted_not_kept(gw: GatewayProc) -> None:
    client = openai_client(gw)
    for i in range(2):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[i]}]
        ask(client, "tiny", messages, n=8)

    def counted() -> bool:
        stats = gw.ps()["tiny"]["prefix_cache"]
        return stats is not None and stats.get("oversize", 0) >= 2

    wait_for(counted, what="two oversize requests in a heartbeat")
    stats = gw.ps()["tiny"]["prefix_cache"]
    assert stats["entries"] == 0 and stats["nbytes"] == 0 and stats["hits"] == 0
    metrics = httpx.get(f"{gw.base_url}/metrics", timeout=10).text
    assert 'mlxgw_prefix_cache_oversize_total{model="tiny"} 2.0' in metrics
