"""worker/prompt_segments.py over tokenizers built like the common model families'
(tests/tokenizer_families.py: Llama 3, Llama 2, Mistral, Qwen2, Gemma), saved and loaded
through mlx-lm's loader as the worker loads a model (so transformers' own tokenizer class
for the family rebuilds the pipeline from the vocabulary, as it does for a real checkpoint),
and where that differs from the file's own pipeline, as written too (PreTrainedTokenizerFast).

Every family passes the probe: its cut tokens are special, matched as written and bounded,
and no other added token matches across one, so the text between two of them tokenizes on
its own. Random conversations encode by segments to the template's own ids, and each next
turn encodes only its new segments. Llama 2 cuts coarsest: [INST] and [/INST] are text to
it, so a question and its answer share a segment, and cutting at them would differ (shown).
Tokenizers where cutting does differ are test_prompt_segments.py's."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer

from shared.config import EngineOptions
from shared.protocol import Add
from shared.types import CanonicalRequest, Message, RequestKind, SamplingParams
from tests.tokenizer_families import LOADS, Family, saved
from worker.preprocess import Preprocessor
from worker.prompt_segments import PromptSegments, prompt_segments


@pytest.fixture(scope="module", params=LOADS, ids=lambda f: f.name)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Family, TokenizerWrapper]:
    """A family's tokenizer saved and loaded by mlx-lm's loader, as the worker loads one."""
    found: Family = request.param
    return found, load_tokenizer(saved(found, tmp_path_factory.mktemp(found.name)))


# ---- conversations ----------------------------------------------------------------------------

WORDS = (
    *("the", "model", "reads", "Héllo", "wörld", "Cafe\u0301", "\u0301", "日本語", "🙂", "🦀"),
    *("42", "1234567", "3.14", "x_y", "def f(x):", '{"a": 1}', "<0x41>", "▁", "▁▁x"),
    *("\n", "\n\n", "\t", "  ", "   ", "user\n", "assistant", "model", "|>", "<|", "[", "]", "<"),
)
EDGES = ("", " ", "  ", "\n", "\n\n", "\t", " \n ", "\u3000")


def words(rng: random.Random, literal: tuple[str, ...]) -> str:
    pieces = WORDS + literal
    body = " ".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
    glued = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 3)))  # no space between
    return rng.choice(EDGES) + body + glued + rng.choice(EDGES)


def conversation(rng: random.Random, fam: Family) -> CanonicalRequest:
    """1-20 turns of user and assistant (alternating: every family's template takes that),
    a system message first where the template takes one, sometimes a last user message."""
    messages = [Message("system", words(rng, fam.literal))]
    messages = messages if fam.system and rng.random() < 0.6 else []
    for _ in range(rng.randint(1, 20)):
        messages.append(Message("user", words(rng, fam.literal)))
        messages.append(Message("assistant", words(rng, fam.literal)))
    if rng.random() < 0.7:
        messages.append(Message("user", words(rng, fam.literal)))
    return CanonicalRequest(messages=messages, add_generation_prompt=rng.random() < 0.8)


def chat_frame(request: CanonicalRequest, request_id: str = "r1") -> Add:
    return Add(request_id, RequestKind.CHAT, request, SamplingParams(max_tokens=1))


def preprocessor(tokenizer: Any, **options: Any) -> Preprocessor:
    return Preprocessor(tokenizer, EngineOptions(**options), max_context=10**7)


def encoder(tokenizer: Any) -> Callable[[list[str]], list[list[int]]]:
    backend = tokenizer.backend_tokenizer
    return lambda texts: [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]


def whole_ids(tokenizer: Any, request: CanonicalRequest) -> list[int]:
    """The template's own ids (apply_chat_template, tokenize=True): what segments must be."""
    messages = [{"role": m.role, "content": m.content} for m in request.messages]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=request.add_generation_prompt, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ---- the tests ------------------------------------------------------------------------------


def test_each_family_loads_as_its_own_pipeline(family: tuple[Family, TokenizerWrapper]) -> None:
    """The fixture is what it claims: the family's pipeline as loaded, its special tokens
    special and matched as written, its other added tokens not special, byte fallback or
    byte-level, and the template's ids its text's (BOS written once, by the template)."""
    fam, tokenizer = family
    backend = tokenizer.backend_tokenizer
    parts = {
        "pre_tokenizer": type(backend.pre_tokenizer).__name__,
        "normalizer": type(backend.normalizer).__name__,
        "model": type(backend.model).__name__,
    }
    if parts["pre_tokenizer"] == "Metaspace":
        parts["prepend_scheme"] = backend.pre_tokenizer.prepend_scheme
    assert parts == fam.pipeline
    added = {t.content: t for t in tokenizer.added_tokens_decoder.values()}
    assert all(added[t].special and not added[t].normalized for t in fam.special)
    assert not any(added[t].special or added[t].normalized for t in fam.markers)
    assert not set(fam.text) & set(added)
    # a character out of the vocabulary: byte tokens, or bytes as byte-level BPE writes them
    crab = tokenizer.convert_ids_to_tokens(tokenizer.encode("🦀", add_special_tokens=False))
    if fam.byte_fallback:
        assert crab[-4:] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x80>"]
    else:
        assert "".join(crab) == "ðŁ¦Ģ"
    request = CanonicalRequest(messages=[Message("user", "hi")])
    text = rendered(tokenizer, request)
    assert whole_ids(tokenizer, request) == tokenizer.encode(text, add_special_tokens=False)


def test_segments_are_the_whole_encoding_over_random_conversations(
    family: tuple[Family, TokenizerWrapper],
) -> None:
    fam, tokenizer = family
    by_segments = preprocessor(tokenizer)
    assert by_segments.segments is not None, f"{fam.name}: segments off at load"
    rng = random.Random(f"families:{fam.name}")
    for i in range(100):
        request = conversation(rng, fam)
        got = by_segments(chat_frame(request, f"r{i}")).prompt
        assert got == whole_ids(tokenizer, request), request
    by_segments.run_checks()  # the first 16, encoded whole too (a worker's input thread)
    segments = by_segments.segments
    assert segments.on, segments.off_reason
    assert segments.stats.shadow_checked == 16 and segments.stats.hits > 0


def test_the_next_turn_encodes_only_its_new_segments(
    family: tuple[Family, TokenizerWrapper],
) -> None:
    """Turn by turn, only the segments not met before are encoded (the answer and the new
    question, where the template puts a special token between them), the rest is the memo's."""
    fam, tokenizer = family
    pre = preprocessor(tokenizer)
    segments = pre.segments
    assert isinstance(segments, PromptSegments)
    history = [Message("system", " Be brief.\n")] if fam.system else []
    seen: set[str] = set()
    for turn in range(4):
        if turn:
            history.append(Message("assistant", f" Hello {turn}! 42 "))
        history.append(Message("user", f"Question {turn}: 日本語 ✓\n"))
        request = CanonicalRequest(messages=list(history))
        parts = segments.split(rendered(tokenizer, request))
        new = set(parts) - seen
        misses, hits = segments.stats.misses, segments.stats.hits
        assert pre(chat_frame(request, f"t{turn}")).prompt == whole_ids(tokenizer, request)
        assert segments.stats.misses - misses == len(new)
        assert segments.stats.hits - hits == sum(p not in new for p in parts)
        if turn > 1:
            assert 0 < len(new) <= fam.new_segments
        if turn >= fam.reused_from:
            assert len(parts) > len(new)
        seen |= new


def rendered(tokenizer: Any, request: CanonicalRequest) -> str:
    messages = [{"role": m.role, "content": m.content} for m in request.messages]
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=request.add_generation_prompt, tokenize=False
    )
    assert isinstance(text, str)
    return text


@pytest.mark.parametrize(
    "family", [f for f in LOADS if f.text], ids=lambda f: f.name, indirect=True
)
def test_template_markers_that_are_text_are_not_cut_at(
    family: tuple[Family, TokenizerWrapper],
) -> None:
    """Llama 2's [INST] and [/INST] are text: its prompts are cut at its special tokens only
    (<s>, </s>; a question and its answer share a segment), since cutting at the markers too
    would change the ids: a piece cut there gets a "▁" of its own before it."""
    fam, tokenizer = family
    segments = prompt_segments(tokenizer)
    assert segments is not None
    assert sorted(segments.tokens) == sorted(fam.special)
    history = [("system", "Be brief."), ("user", "Hi there"), ("assistant", "Hello!")]
    request = CanonicalRequest(messages=[Message(*m) for m in [*history, ("user", "And now?")]])
    text, expected = rendered(tokenizer, request), whole_ids(tokenizer, request)
    assert segments.lookup(segments.split(text)) == expected
    cut_at_text = PromptSegments([*segments.tokens, *fam.text], encoder(tokenizer))
    assert cut_at_text.lookup(cut_at_text.split(text)) != expected
