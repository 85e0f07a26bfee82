"""worker/prompt_segments.py over the generated models' tokenizers and templates: a chat
prompt tokenized by segments is its whole encoding (random conversations), the memo serves
the next turn within its bound, and segments turn off where they would differ: at the probe
(tokenizers built here where cutting is not equivalent), in the shadow check (an encoder
made to err), and by engine.segment_tokens."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from shared.config import EngineOptions
from shared.protocol import Add, PromptSegmentStats
from shared.types import (
    CanonicalRequest,
    Message,
    Reasoning,
    RequestKind,
    SamplingParams,
    Tool,
    ToolCall,
)
from tests.engine_fixtures import Loaded
from worker.chat_templates import CHAT_TEMPLATE
from worker.modelgen import IM_END, SPECIAL_TOKENS
from worker.preprocess import Preprocessor
from worker.prompt_segments import (
    LARGEST_SHARE,
    MEMO_BYTES,
    PromptSegments,
    SegmentMemo,
    crossing,
    cut_tokens,
    entry_bytes,
    matcher,
    probe,
    prompt_segments,
    segment_stats,
)

WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
# Message text: words, accents, wide characters, digits, JSON, whitespace, and the text of
# special and marker tokens (the template's and the tokenizer's: a client may send them).
PIECES = (
    *("the", "model", "reads", "Héllo", "wörld", "日本語", "🙂", "42", "3.14", "x_y"),
    *("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</think>", "<think>"),
    *('{"a": 1}', "\n", "\t", "  ", "user\n", "assistant", "|>", "<|"),
)
EDGES = ("", " ", "  ", "\n", "\n\n", "\t", " \n ")


def words(rng: random.Random) -> str:
    body = " ".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
    return rng.choice(EDGES) + body + rng.choice(EDGES)


def conversation(rng: random.Random, tools: bool) -> CanonicalRequest:
    """1-30 turns: user, then the assistant (text, reasoning, calls) and its calls' results."""
    messages = [Message("system", words(rng))] if rng.random() < 0.6 else []
    for turn in range(rng.randint(1, 30)):
        messages.append(Message("user", words(rng)))
        calls = []
        if tools and rng.random() < 0.4:
            calls = [
                ToolCall(f"c{turn}.{i}", "get_weather", json.dumps({"city": words(rng)}))
                for i in range(rng.randint(1, 2))
            ]
        reasoning = words(rng) if tools and rng.random() < 0.3 else None
        messages.append(Message("assistant", words(rng), tool_calls=calls, reasoning=reasoning))
        messages += [Message("tool", words(rng), tool_call_id=call.id) for call in calls]
    if rng.random() < 0.7:
        messages.append(Message("user", words(rng)))
    return CanonicalRequest(
        messages=messages,
        tools=[WEATHER] if tools and rng.random() < 0.5 else [],
        add_generation_prompt=rng.random() < 0.8,
        reasoning=Reasoning(enabled=rng.choice((None, True, False))) if tools else None,
    )


def chat_frame(request: CanonicalRequest, request_id: str = "r1") -> Add:
    return Add(request_id, RequestKind.CHAT, request, SamplingParams(max_tokens=1))


def preprocessor(tokenizer: Any, **options: Any) -> Preprocessor:
    return Preprocessor(tokenizer, EngineOptions(**options), max_context=10**7)


def whole_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def encoder(tokenizer: Any) -> Any:
    backend = tokenizer.backend_tokenizer
    return lambda texts: [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]


def user_turns_gain(tokenizer: Any, calls: list[list[str]] | None = None) -> Any:
    """Fault injection: an encoder whose user turns gain a token (id 7) over the real one;
    each batch it is asked for goes into `calls`."""
    encode = encoder(tokenizer)

    def erring(texts: list[str]) -> list[list[int]]:
        if calls is not None:
            calls.append(texts)
        return [
            [*ids, 7] if t.startswith("<|im_start|>user") else ids
            for t, ids in zip(texts, encode(texts), strict=True)
        ]

    return erring


MESSAGES = [
    {"role": "system", "content": "Be brief. "},
    {"role": "user", "content": "Hi there\n"},
    {"role": "assistant", "content": " Hello!"},
    {"role": "user", "content": "And now?"},
]


@pytest.fixture(scope="module")
def hermes_tokenizer(hermes_model_dir: Path) -> TokenizerWrapper:
    return load_tokenizer(hermes_model_dir)


@pytest.fixture(scope="module")
def coder_tokenizer(coder_model_dir: Path) -> TokenizerWrapper:
    return load_tokenizer(coder_model_dir)


# ---- the same ids ----------------------------------------------------------------------


@pytest.mark.parametrize("model", ["chat", "hermes_tokenizer", "coder_tokenizer"])
def test_segments_are_the_whole_encoding_over_random_conversations(
    model: str, request: pytest.FixtureRequest
) -> None:
    found = request.getfixturevalue(model)
    tokenizer = found.tokenizer if isinstance(found, Loaded) else found
    by_segments, whole = preprocessor(tokenizer), preprocessor(tokenizer, segment_tokens=False)
    assert by_segments.segments is not None and whole.segments is None
    tools = model != "chat"  # the plain template has no tools and no thinking
    rng = random.Random(f"segments:{model}")
    for i in range(60):
        frame = chat_frame(conversation(rng, tools), f"r{i}")
        assert by_segments(frame).prompt == whole(frame).prompt, frame.request
    by_segments.run_checks()  # the first 16, encoded whole too (a worker's input thread)
    assert by_segments.segments.on, by_segments.segments.off_reason
    stats = by_segments.segments.stats
    assert stats.shadow_checked == 16 and stats.hits > 0 and stats.misses > 0


# ---- the memo ------------------------------------------------------------------------------


def test_the_next_turn_encodes_only_its_new_segments(chat: Loaded) -> None:
    pre = preprocessor(chat.tokenizer)
    assert pre.segments is not None
    history = [Message("system", "Be brief."), Message("user", "Hi there")]
    first = pre(chat_frame(CanonicalRequest(messages=history)))
    # system, its end (twice: encoded once), the user's turn, the assistant's prompt
    assert (pre.segments.stats.misses, pre.segments.stats.hits) == (4, 0)
    history += [Message("assistant", "Hello!"), Message("user", "And now?")]
    second = pre(chat_frame(CanonicalRequest(messages=history)))
    # only the answer and the new question are encoded; the rest is the memo's
    assert (pre.segments.stats.misses, pre.segments.stats.hits) == (4 + 2, 7)
    assert pre.segments.stats.prompts == 2
    assert second.prompt[: len(first.prompt)] == first.prompt
    expected = whole_ids(chat.tokenizer, [{"role": m.role, "content": m.content} for m in history])
    assert second.prompt == expected


def test_the_memo_stays_within_its_bound(chat: Loaded) -> None:
    segments = prompt_segments(chat.tokenizer, memo_bytes=12_000)
    assert segments is not None
    rng = random.Random("memo")
    for _ in range(60):
        text = chat.tokenizer.apply_chat_template(
            [{"role": "user", "content": words(rng)}, {"role": "assistant", "content": "ok"}],
            tokenize=False,
        )
        expected = chat.tokenizer.encode(text, add_special_tokens=False)
        assert segments.lookup(segments.split(text)) == expected
        assert segments.memo_bytes() <= 12_000
    assert segments.stats.evicted > 0
    held = segments.memo_bytes()
    long = "<|im_start|>user\n" + "word " * 200  # over a sixteenth of the bound: not kept
    assert segments.lookup([long]) == chat.tokenizer.encode(long, add_special_tokens=False)
    assert segments.memo_bytes() == held


def test_the_snapshot_is_the_memo_and_its_counts(chat: Loaded) -> None:
    pre = preprocessor(chat.tokenizer)
    assert pre.segments is not None
    assert segment_stats(pre) == PromptSegmentStats(0, 0, MEMO_BYTES)  # after the probe
    history = [Message(m["role"], m["content"]) for m in MESSAGES]
    for turn in (2, 4):
        pre(chat_frame(CanonicalRequest(messages=history[:turn])))
    snapshot = pre.segments.snapshot()
    assert snapshot == segment_stats(pre)
    stats = pre.segments.stats
    assert (snapshot.prompts, snapshot.hits, snapshot.misses) == (2, stats.hits, stats.misses)
    assert snapshot.entries == stats.misses and snapshot.evictions == 0  # each kept
    assert snapshot.nbytes == pre.segments.memo_bytes() > 0
    # none for a preprocessor without segments, or one that turned them off
    assert segment_stats(preprocessor(chat.tokenizer, segment_tokens=False)) is None
    assert segment_stats(object()) is None  # embeddings, speech: no `segments` at all
    pre.segments.turn_off("a test")
    assert segment_stats(pre) is None
    pre.segments.lookup(["<|im_start|>user\nlate"])  # a lookup under way at the turn-off
    assert pre.segments.memo_bytes() == 0  # puts nothing back


def test_the_snapshot_counts_evictions() -> None:
    texts = [f"<|a|>{c}" for c in "abcdefghijklmnopq"]  # 17, each as costly
    one = entry_bytes(texts[0], [6])
    bound = one * LARGEST_SHARE  # room for 16 of them
    segments = PromptSegments(["<|a|>"], lambda batch: [[len(t)] for t in batch], bound)
    for text in [*texts, texts[-1], texts[0]]:  # the first, evicted, comes back
        assert segments.encode(text, lambda: [0]) == [6]
    assert segments.snapshot() == PromptSegmentStats(
        entries=16,
        nbytes=16 * one,
        capacity_bytes=bound,
        prompts=19,
        hits=1,
        misses=18,
        evictions=2,
    )


def test_the_memo_counts_what_it_holds_and_evicts_the_least_recently_used_first() -> None:
    ids = list(range(1_000, 1_010))  # ints Python does not share
    cost = entry_bytes("aa", ids)
    assert cost >= len("aa") + 10 * (8 + 28)  # each id's pointer and int object
    memo = SegmentMemo(max_bytes=LARGEST_SHARE * cost)  # room for 16 such
    texts = [f"{c}{c}" for c in "abcdefghijklmnop"]
    for text in texts:
        assert memo.put(text, ids) == 0
    assert memo.nbytes == 16 * cost and len(memo) == 16
    assert memo.get("aa") == ids  # used: the newest now
    assert memo.put("qq", ids) == 1
    assert memo.get("bb") is None and memo.get("aa") == ids and len(memo) == 16
    assert memo.nbytes == 16 * cost
    # a segment over a sixteenth of the bound is never kept: it would push out the rest
    assert memo.put("z" * 3, ids) == 0 and memo.get("z" * 3) is None and len(memo) == 16


# ---- off where cutting differs ------------------------------------------------------------


def trained(corpus: str = "") -> Tokenizer:
    """A byte-level BPE with ChatML's special tokens, trained here on `corpus` and prose."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    prose = "the model reads a prompt and writes tokens one by one, 42 times. " * 40
    tokenizer.train_from_iterator([prose + corpus], trainer)
    return tokenizer


def wrapped(tokenizer: Tokenizer, **config: Any) -> TokenizerWrapper:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, chat_template=CHAT_TEMPLATE, eos_token=IM_END, **config
    )
    return TokenizerWrapper(fast)


def forced(tokenizer: Any) -> PromptSegments:
    """Segments cut as if they were safe, bypassing every check."""
    return PromptSegments(cut_tokens(tokenizer.added_tokens_decoder.values()), encoder(tokenizer))


@pytest.fixture(scope="module")
def overlapping() -> TokenizerWrapper:
    """An added (not special) token across ChatML's turn boundary: matched whole, it takes
    the newline and the special token after it together."""
    tokenizer = trained()
    tokenizer.add_tokens([AddedToken("\n<|im_start|>", special=False, normalized=False)])
    return wrapped(tokenizer)


@pytest.fixture(scope="module")
def special_as_text() -> TokenizerWrapper:
    """split_special_tokens: special tokens encoded as text, with merges (" <|", "|>\\n")
    across where a prompt would be cut."""
    return wrapped(trained("said <|im_end|>\n<|im_start|>user\n " * 40), split_special_tokens=True)


@pytest.mark.parametrize(
    ("model", "why"),
    [
        ("overlapping", "its added token '\\n<|im_start|>' may match across a special token"),
        ("special_as_text", "its tokenizer encodes special tokens as text"),
    ],
)
def test_a_tokenizer_that_segments_differently_is_found_at_load(
    model: str, why: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = request.getfixturevalue(model)
    expected = whole_ids(tokenizer, MESSAGES)
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    cut = forced(tokenizer)
    assert cut.lookup(cut.split(text)) != expected  # cutting it would change the prompt
    # the conversation through its own template finds it too, without the checks before
    assert (
        probe(tokenizer, forced(tokenizer))
        == "the probe conversation encodes differently by segments"
    )
    with caplog.at_level(logging.INFO, logger="worker.prompt_segments"):
        pre = preprocessor(tokenizer)
    assert pre.segments is None
    assert f"chat prompts are tokenized whole: {why}" in caplog.text
    history = [Message(m["role"], m["content"]) for m in MESSAGES]
    assert pre(chat_frame(CanonicalRequest(messages=history))).prompt == expected


def test_cut_tokens_are_special_tokens_matched_as_written() -> None:
    added = [
        AddedToken("<|im_start|>", special=True, normalized=False),
        AddedToken("<|plain|>", special=False, normalized=False),
        AddedToken("<|norm|>", special=True, normalized=True),
        AddedToken("<|left|>", special=True, normalized=False, lstrip=True),
        AddedToken("<|word|>", special=True, normalized=False, single_word=True),
        AddedToken("system", special=True, normalized=False),  # a word's edges
        AddedToken(" <x>", special=True, normalized=False),  # a space's
    ]
    assert cut_tokens(added) == ["<|im_start|>"]
    assert crossing(added, ["<|im_start|>"]) is None
    for clash in ("a<|im", "x<|im_start|>y", "<|im_start|>user"):
        assert crossing([AddedToken(clash, normalized=False)], ["<|im_start|>"]) == clash
    # a normalized token matches only between the others: never across
    assert crossing([AddedToken("a<|im", normalized=True)], ["<|im_start|>"]) is None


def test_the_matcher_takes_the_longest_token_at_the_leftmost_place() -> None:
    found = matcher(["<a>", "<a>b", "<ab", "b<a"]).finditer("<a>b <a> <ab <a>xb<a>b")
    assert [m.group() for m in found] == ["<a>b", "<a>", "<ab", "<a>", "b<a"]
    segments = PromptSegments(["<a>", "<a>b"], lambda texts: [[len(t)] for t in texts])
    assert segments.split("x<a>by<a>z<a>") == ["x", "<a>by", "<a>z", "<a>"]


# ---- the shadow check, failures, the option -----------------------------------------------


def test_a_shadow_mismatch_turns_segments_off_for_good(
    chat: Loaded, caplog: pytest.LogCaptureFixture
) -> None:
    pre = preprocessor(chat.tokenizer)
    assert pre.segments is not None
    calls: list[list[str]] = []
    pre.segments = PromptSegments(pre.segments.tokens, user_turns_gain(chat.tokenizer, calls))
    pre.off_path = False  # checked first (tests/test_prompt_segments_later.py: after)
    history = [Message(m["role"], m["content"]) for m in MESSAGES]
    expected = whole_ids(chat.tokenizer, MESSAGES)
    with caplog.at_level(logging.WARNING, logger="worker.prompt_segments"):
        assert pre(chat_frame(CanonicalRequest(messages=history), "r-odd")).prompt == expected
    assert not pre.segments.on and "r-odd" in (pre.segments.off_reason or "")
    assert "request r-odd: its prompt tokenized by segments differs" in caplog.text
    asked = len(calls)
    assert pre(chat_frame(CanonicalRequest(messages=history), "r-next")).prompt == expected
    assert len(calls) == asked  # whole from now: the segments' encoder is not asked again


def test_only_the_first_prompts_are_encoded_whole_too(chat: Loaded) -> None:
    segments = PromptSegments(
        ["<|im_start|>", "<|im_end|>"], encoder(chat.tokenizer), shadow_checks=3
    )
    wholes = []

    def ids(text: str) -> list[int]:
        return list(chat.tokenizer.encode(text, add_special_tokens=False))

    def whole(text: str) -> Callable[[], list[int]]:
        def encode() -> list[int]:
            wholes.append(text)
            return ids(text)

        return encode

    for i in range(6):
        text = f"<|im_start|>user\nturn {i}<|im_end|>\n"
        assert segments.encode(text, whole(text)) == ids(text)
    segments.encode("no special token at all", whole("one segment"))  # not counted
    assert len(wholes) == 3 and segments.stats.shadow_checked == 3 and segments.on


def test_an_encoder_that_fails_leaves_the_whole_encoding() -> None:
    def failing(texts: list[str]) -> list[list[int]]:
        raise RuntimeError("no encoder")

    segments = PromptSegments(["<|im_start|>"], failing)
    assert segments.encode("<|im_start|>user\nhi", lambda: [1, 2]) == [1, 2]
    assert segments.off_reason == "encoding by segments failed: no encoder"


def test_the_option_off_and_encoding_kwargs_take_the_whole_encoding(
    hermes_tokenizer: TokenizerWrapper,
) -> None:
    off = preprocessor(hermes_tokenizer, segment_tokens=False)
    assert off.segments is None
    on = preprocessor(hermes_tokenizer)
    assert on.segments is not None
    history = [Message(m["role"], m["content"] + " <|im_end|>") for m in MESSAGES]
    request = CanonicalRequest(messages=history)
    assert off(chat_frame(request)).prompt == on(chat_frame(request)).prompt
    # control tokens in the messages encoded as text: transformers' encoding, whole
    asked = on.segments.stats.misses + on.segments.stats.hits
    sanitized = CanonicalRequest(
        messages=history, chat_template_kwargs={"sanitize_control_tokens": True}
    )
    prompt = on(chat_frame(sanitized)).prompt
    assert prompt == off(chat_frame(sanitized)).prompt != off(chat_frame(request)).prompt
    assert on.segments.stats.misses + on.segments.stats.hits == asked


def test_a_tokenize_call_is_encoded_whole_and_takes_no_check(chat: Loaded) -> None:
    """Rank 0 of a sharded group answers tokenize calls alone: were they among the prompts
    the checks take, its ranks could decide differently about segments."""
    pre = preprocessor(chat.tokenizer)
    assert pre.segments is not None
    history = [Message(m["role"], m["content"]) for m in MESSAGES]
    request = msgspec.to_builtins(CanonicalRequest(messages=history))  # as the gateway sends
    for _ in range(3):
        got = pre.tokenize_call({"kind": RequestKind.CHAT.value, "request": request})
        assert got["tokens"] == whole_ids(chat.tokenizer, MESSAGES)
    stats = pre.segments.stats
    assert (stats.prompts, stats.shadow_checked, pre.segments.snapshot().entries) == (0, 0, 0)
