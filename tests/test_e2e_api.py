"""The OpenAI API's newer surface end to end, through the official openai SDK and httpx
against real worker processes: n choices, logprobs (checked against mlx-lm in-process),
echo, batched prompts, tokenize/detokenize, model cards and capabilities, chat template
kwargs, cancel by request id, and 400s naming unsupported fields and bad values."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import mlx.core as mx
import openai
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from openai.types import Completion

from tests.gateway_proc import GatewayProc, openai_client, running_gateway
from worker.modelgen import IM_END_ID, TinyModelSpec, build_tiny_model, byte_token_id

MESSAGES: Any = [{"role": "user", "content": "Tell me about the sea."}]
PROMPT_TEXT = "The gateway starts one worker per model"
# float32 logits: the worker's batched matmuls and the test's single pass differ in the last
# bits, a little more for large logits (CHAT_SPEC's logit_scale is 8)
ABS_TOL, REL_TOL = 1e-3, 1e-4
# A base model: no chat template (kept tiny: it only has to load and complete)
BASE_SPEC = TinyModelSpec(
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    vocab_size=300,
    seed=3,
    chat_template=False,
)


def close(got: float | None, want: float) -> bool:
    return got is not None and got == pytest.approx(want, abs=ABS_TOL, rel=REL_TOL)


def post(gw: GatewayProc, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{gw.base_url}{path}", json=body, timeout=60)


def tokenize(gw: GatewayProc, **body: Any) -> dict[str, Any]:
    r = post(gw, "/tokenize", body)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def detokenize(gw: GatewayProc, model: str, tokens: list[int]) -> str:
    r = post(gw, "/detokenize", {"model": model, "tokens": tokens})
    assert r.status_code == 200, r.text
    text: str = r.json()["prompt"]
    return text


def chat_tokens(gw: GatewayProc, model: str = "chat", **body: Any) -> list[int]:
    tokens: list[int] = tokenize(gw, model=model, messages=MESSAGES, **body)["tokens"]
    return tokens


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


@pytest.fixture(scope="module")
def extra(tmp_path_factory: pytest.TempPathFactory, chat_model: Path) -> Iterator[GatewayProc]:
    """One more gateway: a model without a chat template, and the session's chat model with
    a configured chat_template_kwargs default (thinking on)."""
    base = build_tiny_model(tmp_path_factory.mktemp("api") / "base", BASE_SPEC)
    models: list[dict[str, Any]] = [
        {"name": "base", "source": str(base)},
        # a TOML dotted key: `[[models]] chat_template_kwargs = { enable_thinking = true }`
        {"name": "think", "source": str(chat_model), "chat_template_kwargs.enable_thinking": True},
        # never loaded unless asked: its card and its capability check come from its files
        {"name": "lazy-base", "source": str(base), "preload": False},
    ]
    with running_gateway(models, request_timeout_s=60.0) as gw:
        yield gw


@pytest.fixture(scope="module")
def extra_client(extra: GatewayProc) -> openai.OpenAI:
    return openai_client(extra)


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


def test_template_call_parameters_are_not_template_variables(
    client: openai.OpenAI, gateway: GatewayProc
) -> None:
    """chat_template_kwargs that would change the templating call itself (return_tensors,
    tokenize, ...) are a 400 naming them; the worker never sees them."""
    for key, value in (("return_tensors", "np"), ("tokenize", False), ("return_dict", True)):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="chat",
                messages=MESSAGES,
                max_tokens=2,
                extra_body={"chat_template_kwargs": {key: value}},
            )
        assert info.value.param == f"chat_template_kwargs.{key}"
        r = post(
            gateway,
            "/tokenize",
            {"model": "chat", "messages": MESSAGES, "chat_template_kwargs": {key: value}},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == f"chat_template_kwargs.{key}"
    assert gateway.ps()["chat"]["restarts"] == 0


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


# ---- tokenize / detokenize -------------------------------------------------------------------


def test_tokenize_detokenize_round_trip(client: openai.OpenAI, gateway: GatewayProc) -> None:
    result = tokenize(gateway, model="chat", prompt=PROMPT_TEXT, return_token_strs=True)
    assert result["count"] == len(result["tokens"]) > 3
    assert result["max_model_len"] == 2048
    assert "".join(result["token_strs"]) == PROMPT_TEXT
    assert detokenize(gateway, "chat", result["tokens"]) == PROMPT_TEXT
    assert detokenize(gateway, "chat-alias", result["tokens"][:2]) == "".join(
        result["token_strs"][:2]
    )
    plain = tokenize(gateway, model="chat", prompt=PROMPT_TEXT)
    assert "token_strs" not in plain and plain["tokens"] == result["tokens"]
    # chat messages: templated exactly as a chat request is
    templated = tokenize(gateway, model="chat", messages=MESSAGES)
    r = client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
    assert r.usage is not None and r.usage.prompt_tokens == templated["count"]
    text = detokenize(gateway, "chat", templated["tokens"])
    assert text.endswith("<|im_start|>assistant\n") and "Tell me about the sea." in text
    bare = tokenize(gateway, model="chat", messages=MESSAGES, add_generation_prompt=False)
    assert bare["tokens"] == templated["tokens"][: bare["count"]] and bare["count"] < len(
        templated["tokens"]
    )


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "chat"}, 400, "prompt"),
        ("/tokenize", {"model": "chat", "prompt": "a", "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {"model": "chat", "messages": []}, 400, "messages"),
        ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
        ("/tokenize", {"model": "chat", "prompt": "a", "extra": 1}, 400, "extra"),
        ("/detokenize", {"model": "chat", "tokens": [10**6]}, 400, "tokens"),
        ("/detokenize", {"model": "chat", "tokens": [-1]}, 400, "tokens[0]"),
    ],
)
def test_tokenize_errors(
    gateway: GatewayProc, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    r = post(gateway, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


# ---- models and capabilities -----------------------------------------------------------------

FULL = ["chat", "completion", "logprobs", "echo", "tokenize", "structured_output"]
BASE = ["completion", "logprobs", "echo", "tokenize", "structured_output"]


def test_model_by_id_and_alias(client: openai.OpenAI) -> None:
    card = client.models.retrieve("chat")
    assert card.id == "chat" and card.object == "model"
    extra = card.model_extra or {}
    assert extra["context_length"] == extra["max_context"] == 2048
    assert extra["capabilities"] == FULL
    assert extra["aliases"] == ["chat-alias"]
    by_alias = client.models.retrieve("chat-alias")
    assert by_alias.id == "chat-alias"
    assert (by_alias.model_extra or {})["capabilities"] == FULL
    other = client.models.retrieve("other").model_extra or {}
    assert other["context_length"] == 256  # its configured engine.max_context
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.code == "model_not_found"


def test_models_list_capabilities(client: openai.OpenAI, extra_client: openai.OpenAI) -> None:
    cards = {m.id: m.model_extra or {} for m in client.models.list().data}
    assert cards["chat"]["capabilities"] == FULL
    assert cards["other"]["context_length"] == 256
    assert all(card["context_length"] for card in cards.values())
    extra = {m.id: m.model_extra or {} for m in extra_client.models.list().data}
    assert extra["base"]["capabilities"] == BASE
    assert extra["think"]["capabilities"] == FULL


def test_an_unloaded_model_is_described_and_checked_from_its_files(
    extra: GatewayProc, extra_client: openai.OpenAI
) -> None:
    card = extra_client.models.retrieve("lazy-base").model_extra or {}
    assert card["state"] == "unloaded"
    assert card["capabilities"] == BASE
    assert card["context_length"] == 2048  # the tiny model's max_position_embeddings
    with pytest.raises(openai.BadRequestError) as info:
        extra_client.chat.completions.create(model="lazy-base", messages=MESSAGES, max_tokens=2)
    assert info.value.param == "messages" and "chat template" in info.value.message
    assert extra.ps()["lazy-base"]["state"] == "unloaded"  # refused without loading it


def test_model_without_chat_template(extra: GatewayProc, extra_client: openai.OpenAI) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            extra_client.chat.completions.create(
                model="base", messages=MESSAGES, max_tokens=2, stream=stream
            )
        assert info.value.param == "messages"
        assert "chat template" in info.value.message
    r = post(extra, "/tokenize", {"model": "base", "messages": MESSAGES})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    done = extra_client.completions.create(
        model="base", prompt="Once upon a time", max_tokens=4, logprobs=2, echo=True
    )
    assert done.choices[0].text.startswith("Once upon a time")
    assert done.choices[0].logprobs is not None
    assert done.usage is not None and done.usage.completion_tokens >= 1
    assert tokenize(extra, model="base", prompt="Once")["count"] >= 1


# ---- chat template kwargs --------------------------------------------------------------------

THINKING_ON: Any = {"chat_template_kwargs": {"enable_thinking": True}}
THINKING_OFF: Any = {"chat_template_kwargs": {"enable_thinking": False}}


def prompt_tokens(client: openai.OpenAI, model: str, **extra_body: Any) -> int:
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=1, extra_body=extra_body
    )
    assert r.usage is not None
    return r.usage.prompt_tokens


def test_chat_template_kwargs_change_the_prompt(
    client: openai.OpenAI, gateway: GatewayProc
) -> None:
    plain = chat_tokens(gateway)
    thinking = chat_tokens(gateway, **THINKING_ON)
    assert thinking[: len(plain)] == plain and len(thinking) > len(plain)
    assert detokenize(gateway, "chat", thinking[len(plain) :]) == "<think>\n"
    assert chat_tokens(gateway, **THINKING_OFF) == plain
    assert prompt_tokens(client, "chat") == len(plain)
    assert prompt_tokens(client, "chat", **THINKING_ON) == len(thinking)


def test_model_default_chat_template_kwargs(
    gateway: GatewayProc, extra: GatewayProc, extra_client: openai.OpenAI
) -> None:
    """`think` is the chat model with enable_thinking = true configured: on by default, and a
    request's own chat_template_kwargs override it."""
    plain = chat_tokens(gateway)
    thinking = chat_tokens(gateway, **THINKING_ON)
    assert chat_tokens(extra, "think") == thinking
    assert chat_tokens(extra, "think", **THINKING_OFF) == plain
    assert prompt_tokens(extra_client, "think") == len(thinking)
    assert prompt_tokens(extra_client, "think", **THINKING_OFF) == len(plain)
    # completions have no template: the default does not touch them
    c = extra_client.completions.create(model="think", prompt=PROMPT_TEXT, max_tokens=1)
    assert c.usage is not None
    assert c.usage.prompt_tokens == tokenize(gateway, model="chat", prompt=PROMPT_TEXT)["count"]


def test_continue_final_message(client: openai.OpenAI, gateway: GatewayProc) -> None:
    messages: Any = [*MESSAGES, {"role": "assistant", "content": "The sea is"}]
    kwargs = {"model": "chat", "messages": messages}
    closed = tokenize(gateway, add_generation_prompt=False, **kwargs)["tokens"]
    opened = tokenize(
        gateway,
        add_generation_prompt=False,
        chat_template_kwargs={"continue_final_message": True},
        **kwargs,
    )["tokens"]
    assert closed[: len(opened)] == opened
    assert detokenize(gateway, "chat", closed[len(opened) :]) == "<|im_end|>\n"
    r = client.chat.completions.create(
        model="chat",
        messages=messages,
        max_tokens=8,
        temperature=0,
        # add_generation_prompt stays at its default (true): continuing turns it off
        extra_body={"continue_final_message": True, "ignore_eos": True},
    )
    assert r.usage is not None and r.usage.prompt_tokens == len(opened)
    same = client.completions.create(
        model="chat", prompt=opened, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.content == same.choices[0].text  # it continues the message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="chat", messages=MESSAGES, extra_body={"continue_final_message": True}
        )
    assert info.value.param == "continue_final_message"


def test_neutral_values_are_accepted(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="chat",
        messages=MESSAGES,
        max_tokens=2,
        store=False,
        modalities=["text"],
        response_format={"type": "text"},
        tools=[],
        tool_choice="none",
        parallel_tool_calls=False,
        service_tier="auto",
        user="u",
        safety_identifier="s",
        prompt_cache_key="k",
        logprobs=False,
        stream_options=None,
    )
    assert r.choices[0].logprobs is None


# ---- 400s naming the field -------------------------------------------------------------------

CHAT_UNSUPPORTED = [
    ({"store": True}, "store"),
    ({"metadata": {"k": "v"}}, "metadata"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"verbosity": "low"}, "verbosity"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": [{"type": "web_search", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"extra_body": {"fancy_knob": 1}}, "fancy_knob"),
]


@pytest.mark.parametrize(
    ("fields", "param"), CHAT_UNSUPPORTED, ids=[p for _, p in CHAT_UNSUPPORTED]
)
def test_chat_unsupported_field(client: openai.OpenAI, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=2, **fields)
    assert info.value.param == param
    assert param in info.value.message
    assert info.value.code == "invalid_request"


MISSING_CAPABILITY = [
    ({"reasoning_effort": "low"}, "reasoning_effort", "thinking"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool"),
]


@pytest.mark.parametrize(
    ("fields", "param", "words"), MISSING_CAPABILITY, ids=[p for _, p, _ in MISSING_CAPABILITY]
)
def test_what_the_model_lacks_is_named(
    client: openai.OpenAI, fields: dict[str, Any], param: str, words: str
) -> None:
    """The chat model's template has neither tools nor thinking: Ready says so."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=2, **fields)
    assert info.value.param == param
    assert words in info.value.message


COMPLETION_UNSUPPORTED = [
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"extra_body": {"store": True}}, "store"),
    ({"extra_body": {"messages": MESSAGES}}, "messages"),
]


@pytest.mark.parametrize(
    ("fields", "param"), COMPLETION_UNSUPPORTED, ids=[p for _, p in COMPLETION_UNSUPPORTED]
)
def test_completion_unsupported_field(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="chat", prompt="Once", max_tokens=2, **fields)
    assert info.value.param == param


BAD_CHAT_VALUES = [
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
]


@pytest.mark.parametrize(
    ("fields", "param"), BAD_CHAT_VALUES, ids=[str(f) for f, _ in BAD_CHAT_VALUES]
)
def test_bad_chat_values(client: openai.OpenAI, fields: dict[str, Any], param: str) -> None:
    body: Any = {"model": "chat", "messages": MESSAGES, "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    assert info.value.status_code == 400
    assert info.value.param == param


BAD_COMPLETION_VALUES = {
    "logprobs-21": ({"logprobs": 21}, "logprobs"),
    "max_tokens-0": ({"max_tokens": 0}, "max_tokens"),  # only with echo
    "prompt-empty": ({"prompt": []}, "prompt"),
    "prompt-empty-ids": ({"prompt": [[1, 2], []]}, "prompt"),
    "130-choices": ({"prompt": ["a"] * 65, "n": 2}, "n"),  # at most 128
}


@pytest.mark.parametrize(
    ("fields", "param"), BAD_COMPLETION_VALUES.values(), ids=BAD_COMPLETION_VALUES.keys()
)
def test_bad_completion_values(client: openai.OpenAI, fields: dict[str, Any], param: str) -> None:
    body: Any = {"model": "chat", "prompt": "Once", "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**body)
    assert info.value.param == param
