"""The OpenAI API's request surface end to end, through the official openai SDK and httpx
against real worker processes: tokenize/detokenize, model cards and capabilities (of loaded
and unloaded models, with and without a chat template), chat template kwargs and their
configured defaults, continue_final_message, neutral values accepted, and 400s naming
unsupported fields, missing capabilities and bad values."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.api_calls import MESSAGES, PROMPT_TEXT, chat_tokens, detokenize, post, tokenize
from tests.gateway_proc import GatewayProc, openai_client, running_gateway
from worker.modelgen import TinyModelSpec, build_tiny_model

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
