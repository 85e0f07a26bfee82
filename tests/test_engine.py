"""EngineCore in-process on real tiny MLX models: greedy tokens equal mlx-lm's, alone, in a
batch and joining one, from a raw prompt or a preprocessed request; the text is the decoded
tokens, a UTF-8 character split across byte tokens included.

Stopping and aborts, sampling, and log probabilities are in the test_engine_*.py files
beside this one."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from mlx_lm import stream_generate
from mlx_lm.models.cache import BatchKVCache

from shared.config import EngineOptions
from shared.protocol import Add
from shared.types import CanonicalRequest, FinishReason, Message, RequestKind, SamplingParams, Usage
from tests.engine_fixtures import (
    Loaded,
    drive,
    finish,
    greedy,
    load,
    reference_greedy,
    text,
    token_ids,
)
from worker.modelgen import IM_END_ID, TinyModelSpec, build_tiny_model, byte_token_id
from worker.preprocess import PreparedRequest, Preprocessor

# Every engine test runs over each continuous batch (engine.batcher).
pytestmark = pytest.mark.usefixtures("batcher")

EOS = IM_END_ID
# A byte-level vocabulary: bigram chains over raw byte tokens.
BYTES_SPEC = TinyModelSpec(hidden_size=64, num_layers=1, vocab_size=400, byte_fallback=True)


# ---- greedy equality with mlx-lm ------------------------------------------------------------


def test_greedy_alone_matches_mlx_lm(chat: Loaded, prompts: list[list[int]]) -> None:
    prompt = prompts[0]
    out = drive(chat.engine(), [greedy("a", prompt, 24, ignore_eos=True)])["a"]
    assert token_ids(out) == reference_greedy(chat.model, prompt, 24)
    assert [len(o.token_ids) for o in out] == [1] * 24  # one token per step, no lag
    assert finish(out) is FinishReason.LENGTH


def test_greedy_deltas_match_stream_generate(chat: Loaded, prompts: list[list[int]]) -> None:
    """Same tokens and per-step text as mlx-lm's stream_generate (EOS honoured), except that
    the first segment keeps the leading space mlx-lm trims (ours equals tokenizer.decode)."""
    for i, prompt in enumerate(prompts[:4]):
        ours = drive(chat.engine(), [greedy("a", prompt, 20)])["a"]
        theirs = list(stream_generate(chat.model, chat.tokenizer, prompt, max_tokens=20))
        assert [o.token_ids for o in ours] == [[r.token] for r in theirs], i
        assert "".join(o.text for o in ours).lstrip() == "".join(r.text for r in theirs), i
        assert [o.text for o in ours][1:] == [r.text for r in theirs][1:], i
        assert finish(ours) == theirs[-1].finish_reason


@pytest.mark.parametrize(
    "options",
    [
        {"max_running": 16},
        {"max_running": 16, "prefill_batch_size": 3, "prefill_step_size": 5},
    ],
    ids=["default-prefill", "chunked-prefill"],
)
def test_greedy_in_a_batch_of_nine_matches_mlx_lm(
    chat: Loaded, prompts: list[list[int]], options: dict[str, int]
) -> None:
    lengths = [24, 10, 17, 24, 5, 20, 12, 24, 8]
    requests = [
        greedy(f"r{i}", p, n, ignore_eos=True)
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    outputs = drive(chat.engine(**options), requests)
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        out = outputs[f"r{i}"]
        assert token_ids(out) == reference_greedy(chat.model, prompt, n), f"r{i}"
        assert out[-1].usage == Usage(prompt_tokens=len(prompt), completion_tokens=n)


def test_late_joiner_matches_mlx_lm(chat: Loaded, prompts: list[list[int]]) -> None:
    """A request added while others are decoding gets the same greedy tokens."""
    engine = chat.engine()
    for i in range(4):
        engine.add(greedy(f"early{i}", prompts[i + 1], 30, ignore_eos=True))
    early: dict[str, list[int]] = {}
    for _ in range(6):
        for o in engine.step():
            early.setdefault(o.request_id, []).extend(o.token_ids)
    late = drive(engine, [greedy("late", prompts[0], 16, ignore_eos=True)])["late"]
    assert token_ids(late) == reference_greedy(chat.model, prompts[0], 16)
    assert not engine.has_work


def test_text_is_the_decoded_tokens(chat: Loaded, prompts: list[list[int]]) -> None:
    prompt = prompts[0]
    out = drive(chat.engine(), [greedy("a", prompt, 12, ignore_eos=True)])["a"]
    assert chat.tokenizer.decode(token_ids(out)).startswith(" ")  # this prompt's continuation
    assert text(out) == chat.tokenizer.decode(token_ids(out))


def test_prepared_request_runs(chat: Loaded) -> None:
    preprocess = Preprocessor(chat.tokenizer, EngineOptions(default_max_tokens=8), max_context=64)
    request = CanonicalRequest(messages=[Message("user", "Tell me about the sea.")])
    sampling = SamplingParams(temperature=0.0, max_tokens=6)
    ready = preprocess(Add("r1", RequestKind.CHAT, request, sampling))
    assert isinstance(ready, PreparedRequest)
    out = drive(chat.engine(), [ready])["r1"]
    reference = reference_greedy(chat.model, ready.prompt, 6)
    stop = reference.index(EOS) + 1 if EOS in reference else 6
    assert token_ids(out) == reference[:stop]


# ---- UTF-8 --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def utf8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Loaded, list[int], dict[str, int]]:
    root = tmp_path_factory.mktemp("bytes")
    plain = build_tiny_model(root / "plain", BYTES_SPEC)
    ids = {
        name: byte_token_id(plain, value)
        for name, value in (("x", ord("x")), ("a", ord("a")), ("b", ord("b")), ("c3", 0xC3))
    }
    ids["a9"] = byte_token_id(plain, 0xA9)
    # prompt ends in "a" -> 0xC3 -> 0xA9 -> "b" -> EOS
    chain = {ids["a"]: ids["c3"], ids["c3"]: ids["a9"], ids["a9"]: ids["b"], ids["b"]: EOS}
    path = build_tiny_model(root / "chain", dataclasses.replace(BYTES_SPEC, bigram=chain))
    assert byte_token_id(path, 0xC3) == ids["c3"]  # same tokenizer
    return load(path), [ids["x"], ids["a"]], ids


def test_utf8_split_across_byte_tokens(utf8: tuple[Loaded, list[int], dict[str, int]]) -> None:
    loaded, prompt, ids = utf8
    out = drive(loaded.engine(), [greedy("u", prompt, 10)])["u"]
    assert token_ids(out) == [ids["c3"], ids["a9"], ids["b"], EOS]
    deltas = [o.text for o in out]
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[0] == ""  # 0xC3 alone is no character yet
    assert "\u00e9" in deltas[1]
    assert text(out) == "\u00e9b"
    assert finish(out) is FinishReason.STOP


def test_utf8_stop_string_after_a_split_character(
    utf8: tuple[Loaded, list[int], dict[str, int]],
) -> None:
    loaded, prompt, _ = utf8
    out = drive(loaded.engine(), [greedy("u", prompt, 10, stop=["b"])])["u"]
    assert text(out) == "\u00e9"
    assert finish(out) is FinishReason.STOP
    out = drive(loaded.engine(), [greedy("u", prompt, 10, stop=["\u00e9"])])["u"]
    assert text(out) == ""
    assert finish(out) is FinishReason.STOP


def test_utf8_in_a_batch(utf8: tuple[Loaded, list[int], dict[str, int]]) -> None:
    loaded, prompt, ids = utf8
    requests = [greedy(f"u{i}", [ids["x"]] * i + prompt, 10) for i in range(5)]
    outputs = drive(loaded.engine(), requests)
    for deltas in outputs.values():
        assert [o.text for o in deltas] == ["", "\u00e9", "b", ""]


# ---- the load's probe ----------------------------------------------------------------------


def test_the_probe_takes_a_served_batch_s_paths_and_leaves_the_engine_as_it_found_it(
    chat: Loaded, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At load, the probe's rows join as a padded group, another joins them while they
    decode, and the batch compacts as they leave (the paths whose kernels MLX's CUDA backend
    compiles at first use); afterwards nothing is left and greedy tokens are mlx-lm's."""
    calls: list[str] = []
    for name in ("finalize", "extend", "filter"):
        method = getattr(BatchKVCache, name)

        def counted(self: Any, *args: Any, _method: Any = method, _name: str = name) -> Any:
            calls.append(_name)
            return _method(self, *args)

        monkeypatch.setattr(BatchKVCache, name, counted)
    engine = chat.engine(prefix_cache_gb=0.5)
    engine.probe()
    assert not engine.has_work
    assert not engine.backend.active
    stats = engine.prefix_stats()
    assert stats is not None and stats.entries == 0 and stats.nbytes == 0
    if getattr(engine.backend, "batch", None) is not None:  # the rows batch
        assert {"finalize", "extend", "filter"} <= set(calls), calls
    prompt = prompts[2]
    out = drive(engine, [greedy("a", prompt, 12, ignore_eos=True)])["a"]
    assert token_ids(out) == reference_greedy(chat.model, prompt, 12)
