"""The OpenAI API's choices end to end, through the official openai SDK against real worker
processes: n choices (streamed, seeded), greedy logprobs checked against mlx-lm in-process,
logprob bytes, echo with logprobs in lm-evaluation-harness's shape, and batched prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import openai
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from openai.types import Completion

from tests.api_calls import MESSAGES, PROMPT_TEXT, chat_tokens, tokenize
from tests.gateway_proc import GatewayProc
from worker.modelgen import IM_END_ID, byte_token_id

# float32 logits: the worker's batched matmuls and the test's single pass differ in the last
# bits, a little more for large logits (CHAT_SPEC's logit_scale is 8)
ABS_TOL, REL_TOL = 1e-3, 1e-4


def close(got: float | None, want: float) -> bool:
    return got is not None and got == pytest.approx(want, abs=ABS_TOL, rel=REL_TOL)


class Reference:
    """The same tiny model loaded with mlx-lm in the test process."""

    def __init__(self, path: Path) -> None:
        self.model, self.tokenizer = load(str(path))[:2]

    def rows(self, tokens: list[int]) -> mx.array:
        """Log-softmax of one forward pass over `tokens`: row i scores token i + 1."""
        logits = self.model(mx.array(tokens)[None])[0].astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        steps = zip(generate_step(mx.array(prompt), self.model), range(n), strict=False)
        return [int(token) for (token, _), _ in steps]

    def text(self, token: int) -> str:
        text: str = self.tokenizer.decode([token])
        return text

    def top(self, row: mx.array, k: int) -> list[tuple[str, float]]:
        ids: list[int] = mx.argsort(-row)[:k].tolist()  # type: ignore[assignment]
        return [(self.text(t), value(row[t])) for t in ids]


def value(x: mx.array) -> float:
    return cast(float, x.item())


@pytest.fixture(scope="module")
def reference(chat_model: Path) -> Reference:
    return Reference(chat_model)


# ---- n choices -------------------------------------------------------------------------------


def test_n_choices(client: openai.OpenAI) -> None:
    one = client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
    assert one.usage is not None
    r = client.chat.completions.create(
        model="chat",
        messages=MESSAGES,
        max_tokens=6,
        n=3,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.content for c in r.choices)
    assert r.usage is not None
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt, counted once
    assert r.usage.completion_tokens == 3 * 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 18
    c = client.completions.create(
        model="chat",
        prompt=PROMPT_TEXT,
        max_tokens=4,
        n=3,
        best_of=3,  # allowed when equal to n
        extra_body={"ignore_eos": True},
    )
    assert [choice.index for choice in c.choices] == [0, 1, 2]
    assert c.usage is not None and c.usage.completion_tokens == 12


def test_n_choices_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="chat",
        messages=MESSAGES,
        max_tokens=5,
        n=3,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert sorted(roles) == [0, 1, 2]
    finishes: dict[int, list[str]] = {}
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    assert len({chunk.id for chunk in chunks}) == 1
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}  # each index ends once
    assert all(texts.values())
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 15
    # nothing of a choice after its finish
    for index in range(3):
        positions = [i for i, c in enumerate(chunks) for ch in c.choices if ch.index == index]
        finish_at = next(
            i
            for i, c in enumerate(chunks)
            for ch in c.choices
            if ch.index == index and ch.finish_reason
        )
        assert positions[-1] == finish_at


def test_seeded_n_is_reproducible(client: openai.OpenAI) -> None:
    """Choice i of a seeded request is sampled with seed + i: the same every time, and the
    same as a single choice asked for with that seed."""

    def texts(seed: int, n: int) -> list[str]:
        r = client.completions.create(
            model="chat",
            prompt=PROMPT_TEXT,
            max_tokens=12,
            n=n,
            seed=seed,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = texts(100, 3)
    assert texts(100, 3) == first
    assert [texts(100 + i, 1)[0] for i in range(3)] == first
    assert len(set(first)) > 1  # independent samples, not one sample three times


# ---- greedy and logprobs ---------------------------------------------------------------------


def test_greedy_stream_and_non_stream_agree(client: openai.OpenAI) -> None:
    kwargs: Any = {
        "model": "chat",
        "messages": MESSAGES,
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": True,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert content is not None and len(content) == 24
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert [e.token for e in streamed] == [e.token for e in content]  # token for token
    assert all(close(a.logprob, b.logprob) for a, b in zip(streamed, content, strict=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content == "".join(e.token for e in content)


def test_chat_logprobs_match_mlx_lm(
    client: openai.OpenAI, gateway: GatewayProc, reference: Reference
) -> None:
    prompt = chat_tokens(gateway)
    r = client.chat.completions.create(
        model="chat",
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"ignore_eos": True},
    )
    assert r.usage is not None and r.usage.prompt_tokens == len(prompt)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    generated = reference.greedy(prompt, 10)
    assert [e.token for e in content] == [reference.text(t) for t in generated]
    rows = reference.rows(prompt + generated[:-1])[len(prompt) - 1 :]
    for i, (entry, token) in enumerate(zip(content, generated, strict=True)):
        assert close(entry.logprob, value(rows[i, token])), (i, entry.logprob)
        assert entry.bytes == list(entry.token.encode())
        top = entry.top_logprobs
        values = [t.logprob for t in top]
        assert len(top) == 5 and values == sorted(values, reverse=True)
        assert top[0].token == entry.token and top[0].logprob == entry.logprob  # greedy
        want = reference.top(rows[i], 5)
        assert [t.token for t in top] == [token for token, _ in want]
        assert all(close(t.logprob, v) for t, (_, v) in zip(top, want, strict=True))


def test_chat_logprob_bytes_rebuild_split_characters(
    client: openai.OpenAI, gateway: GatewayProc, bytes_model: Path
) -> None:
    """OpenAI's `bytes` exist for characters spread over several tokens: joined, they are
    the text. The bytes model spells "é" (C3 A9) one byte token at a time after "a"."""
    messages: Any = [*MESSAGES, {"role": "assistant", "content": "a"}]
    prompt = tokenize(
        gateway,
        model="bytes",
        messages=messages,
        add_generation_prompt=False,
        chat_template_kwargs={"continue_final_message": True},
    )["tokens"]
    assert prompt[-1] == byte_token_id(bytes_model, ord("a"))
    r = client.chat.completions.create(
        model="bytes",
        messages=messages,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert r.choices[0].message.content == "éé"
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert b"".join(bytes(e.bytes or []) for e in content).decode() == "éé"
    # The legacy shape: text offsets advance by the characters each token completes.
    c = client.completions.create(
        model="bytes",
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        logprobs=1,
    )
    assert c.choices[0].text == "éé"
    legacy = c.choices[0].logprobs
    assert legacy is not None and legacy.text_offset == [0, 0, 1, 1]


def loglikelihood(
    client: openai.OpenAI, prompt: list[int], max_tokens: int, **extra: Any
) -> Completion:
    """lm-evaluation-harness's loglikelihood request: the prompt as one list of token ids,
    echo, logprobs 1, greedy."""
    return client.completions.create(
        model="chat",
        prompt=[prompt],
        echo=True,
        logprobs=1,
        max_tokens=max_tokens,
        temperature=0,
        **extra,
    )


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_in_lm_eval_harness_shape(
    client: openai.OpenAI, gateway: GatewayProc, reference: Reference, max_tokens: int
) -> None:
    """lm-evaluation-harness's loglikelihood request: the prompt as one list of token ids,
    echo, logprobs 1, max_tokens 0 or 1, greedy."""
    prompt = tokenize(gateway, model="chat", prompt=PROMPT_TEXT)["tokens"]
    r = loglikelihood(client, prompt, max_tokens, extra_body={"ignore_eos": True})
    (choice,) = r.choices
    assert choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    generated = reference.greedy(prompt, 1)[:max_tokens]
    tokens = prompt + generated
    assert lp.tokens == [reference.text(t) for t in tokens]
    assert choice.text == reference.tokenizer.decode(tokens)
    assert choice.text.startswith(PROMPT_TEXT)
    assert lp.token_logprobs[0] is None  # nothing predicts the first token
    assert lp.top_logprobs[0] is None
    rows = reference.rows(tokens)
    for i in range(1, len(tokens)):
        assert close(lp.token_logprobs[i], value(rows[i - 1, tokens[i]])), i
        (best, best_logprob), *_ = reference.top(rows[i - 1], 1)
        want = {best: pytest.approx(best_logprob, abs=ABS_TOL, rel=REL_TOL)}
        assert lp.top_logprobs[i] == want
    if generated:  # the generated token is the greedy one: its own top entry
        assert lp.top_logprobs[-1] == {lp.tokens[-1]: lp.token_logprobs[-1]}
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), max_tokens)


def test_echo_logprobs_keep_a_generated_end_of_sequence(
    client: openai.OpenAI, gateway: GatewayProc, reference: Reference
) -> None:
    """lm-eval reads token_logprobs[ctxlen:-1] with max_tokens 1: the generated token must
    be there even when it is EOS (which the text never shows)."""
    prompt = tokenize(gateway, model="chat", prompt=PROMPT_TEXT)["tokens"]
    r = loglikelihood(client, prompt, 1, logit_bias={str(IM_END_ID): 100})
    (choice,) = r.choices
    assert choice.finish_reason == "stop"
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(prompt) + 1
    assert lp.token_logprobs[-1] is not None and lp.token_logprobs[-1] > -1.0
    assert r.usage is not None and r.usage.completion_tokens == 1


def test_echo_text_prompt_and_stream(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="chat", prompt=PROMPT_TEXT, echo=True, max_tokens=3, temperature=0
    )
    assert r.choices[0].text.startswith(PROMPT_TEXT)
    assert r.choices[0].logprobs is None
    chunks = list(
        client.completions.create(
            model="chat", prompt=PROMPT_TEXT, echo=True, max_tokens=3, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    scored = client.completions.create(model="chat", prompt=PROMPT_TEXT, echo=True, max_tokens=0)
    assert scored.choices[0].text == PROMPT_TEXT


# ---- batched prompts -------------------------------------------------------------------------


def test_batched_prompts(client: openai.OpenAI, gateway: GatewayProc) -> None:
    prompts = ["Once upon a time", "def add(a, b):"]
    single = [
        client.completions.create(
            model="chat", prompt=p, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        for p in prompts
    ]
    r = client.completions.create(
        model="chat",
        prompt=prompts,
        max_tokens=6,
        n=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:  # choice index = prompt index * n + j
        assert c.text == single[c.index // 2].choices[0].text
    counts = [tokenize(gateway, model="chat", prompt=p)["count"] for p in prompts]
    assert r.usage is not None
    assert r.usage.prompt_tokens == sum(counts)  # each prompt once, not once per choice
    assert r.usage.completion_tokens == 4 * 6
    # token-id prompts, streamed: every index finishes exactly once
    ids = [tokenize(gateway, model="chat", prompt=p)["tokens"] for p in prompts]
    chunks = list(
        client.completions.create(
            model="chat",
            prompt=ids,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    texts = {0: "", 1: ""}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    assert finishes == {0: ["length"], 1: ["length"]}
    assert [texts[i] for i in range(2)] == [s.choices[0].text for s in single]
