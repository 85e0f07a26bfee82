"""Generation semantics through the gateway: greedy equality with mlx-lm, UTF-8, stop strings."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import mlx.core as mx
import openai
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from worker.modelgen import byte_token_id

PROMPT = [{"role": "user", "content": "Write one line about rivers and stones."}]
N = 40


def mlx_lm_greedy(model_dir: Path, messages: list[dict[str, str]], n: int) -> str:
    """mlx-lm's own in-process greedy generation: the reference."""
    model, tokenizer = load(str(model_dir))[:2]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    steps = zip(generate_step(mx.array(prompt), model), range(n), strict=False)
    tokens = [int(t) for (t, _), _i in steps]
    return str(tokenizer.decode(tokens))


def _served(client: openai.OpenAI, messages: list[dict[str, str]]) -> tuple[str, int]:
    r = client.chat.completions.create(
        model="chat",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=N,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage is not None
    return r.choices[0].message.content or "", r.usage.completion_tokens


def test_greedy_matches_mlx_lm_alone_and_in_batch(client: openai.OpenAI, chat_model: Path) -> None:
    reference = mlx_lm_greedy(chat_model, PROMPT, N)
    assert len(reference) > 10
    assert _served(client, PROMPT) == (reference, N)

    others = [[{"role": "user", "content": f"other request {i} " * (i + 1)}] for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        noise = [pool.submit(_served, client, m) for m in others]
        mine = pool.submit(_served, client, PROMPT)
        assert mine.result(timeout=120) == (reference, N)
        for f in noise:
            f.result(timeout=120)


def _bytes_stream(client: openai.OpenAI, prompt: list[int], **kwargs: object) -> list[str]:
    chunks = client.completions.create(
        model="bytes",
        prompt=prompt,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
        **kwargs,  # type: ignore[arg-type]
    )
    return [c.choices[0].text for c in chunks if c.choices]


def test_utf8_split_across_tokens_is_never_broken(client: openai.OpenAI, bytes_model: Path) -> None:
    start = byte_token_id(bytes_model, ord("a"))
    deltas = _bytes_stream(client, [start], max_tokens=10)  # C3 A9 x5
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == "é" * 5
    # Each character arrives whole: no delta ever carries half of one.
    assert all(set(d) <= {"é"} for d in deltas)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_split_across_tokens(
    client: openai.OpenAI, bytes_model: Path, stream: bool
) -> None:
    start = byte_token_id(bytes_model, ord("x"))
    kwargs = {"model": "bytes", "prompt": [start], "max_tokens": 12, "temperature": 0}
    plain = client.completions.create(**kwargs, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    assert plain.choices[0].text == "yzx" * 4
    # "zx" spans two tokens ('z' then 'x'); "y" is all that may be shown.
    if stream:
        text = "".join(_bytes_stream(client, [start], max_tokens=12, stop=["zx", "never"]))
    else:
        r = client.completions.create(**kwargs, stop=["zx", "never"])  # type: ignore[call-overload]
        assert r.choices[0].finish_reason == "stop"
        assert r.usage is not None and r.usage.completion_tokens == 3
        text = r.choices[0].text
    assert text == "y"


def test_stop_string_include_in_output(client: openai.OpenAI, bytes_model: Path) -> None:
    start = byte_token_id(bytes_model, ord("x"))
    r = client.completions.create(
        model="bytes",
        prompt=[start],
        max_tokens=12,
        temperature=0,
        stop="zx",
        extra_body={"include_stop_str_in_output": True},
    )
    assert r.choices[0].text == "yzx"


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def run(seed: int) -> str:
        r = client.chat.completions.create(
            model="chat",
            messages=PROMPT,  # type: ignore[arg-type]
            max_tokens=20,
            temperature=1.0,
            top_p=0.9,
            seed=seed,
            extra_body={"ignore_eos": True, "top_k": 50},
        )
        return r.choices[0].message.content or ""

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_logit_bias_and_min_tokens(client: openai.OpenAI, bytes_model: Path) -> None:
    forced = byte_token_id(bytes_model, ord("q"))
    r = client.completions.create(
        model="chat",
        prompt="hello",
        max_tokens=5,
        temperature=0,
        logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True},
    )
    assert r.usage is not None and r.usage.completion_tokens == 5
    # The 'chat' model's vocabulary differs; bias toward its own EOS instead.
    eos = 2
    r = client.completions.create(
        model="chat", prompt="hello", max_tokens=20, temperature=0, logit_bias={str(eos): 100}
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == 1
    assert r.choices[0].text == ""  # EOS is counted, never shown
    r = client.completions.create(
        model="chat",
        prompt="hello",
        max_tokens=20,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"min_tokens": 6},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == 7
