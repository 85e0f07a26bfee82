"""A prompt's segment check left for after its request went on (`Preprocessor.off_path`, a
worker's default; `PromptSegments.encode(check_later=True)`): the first
prompts of a fresh worker get their segments' ids at once and are encoded whole too only by
`run_checks`, which turns segments off for later prompts where the two differ."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from shared.config import EngineOptions
from shared.types import CanonicalRequest, Message
from tests.engine_fixtures import Loaded
from tests.test_prompt_segments import (
    MESSAGES,
    chat_frame,
    encoder,
    preprocessor,
    user_turns_gain,
    whole_ids,
)
from worker.backends.formats import model_formats
from worker.loader import LoadedModel
from worker.opening import text_preprocessor
from worker.prompt_segments import PromptSegments

CUTS = ["<|im_start|>", "<|im_end|>"]


def counted(chat: Loaded, wholes: list[str]) -> Callable[[str], Callable[[], list[int]]]:
    def whole(text: str) -> Callable[[], list[int]]:
        def encode() -> list[int]:
            wholes.append(text)
            return list(chat.tokenizer.encode(text, add_special_tokens=False))

        return encode

    return whole


def turn(i: int) -> str:
    return f"<|im_start|>user\nturn {i}<|im_end|>\n<|im_start|>assistant\n"


def test_a_check_left_for_later_encodes_whole_only_when_run(chat: Loaded) -> None:
    segments = PromptSegments(CUTS, encoder(chat.tokenizer), shadow_checks=3)
    wholes: list[str] = []
    whole = counted(chat, wholes)
    for i in range(2):
        expected = list(chat.tokenizer.encode(turn(i), add_special_tokens=False))
        assert segments.encode(turn(i), whole(turn(i)), f"r{i}", check_later=True) == expected
    assert wholes == [] and segments.stats.shadow_checked == 2
    segments.run_checks()
    assert wholes == [turn(0), turn(1)] and segments.on
    segments.run_checks()  # each once
    assert len(wholes) == 2


def test_checks_left_for_later_are_the_first_prompts_only(chat: Loaded) -> None:
    segments = PromptSegments(CUTS, encoder(chat.tokenizer), shadow_checks=3)
    wholes: list[str] = []
    whole = counted(chat, wholes)
    for i in range(6):
        segments.encode(turn(i), whole(turn(i)), check_later=True)
    segments.run_checks()
    assert wholes == [turn(0), turn(1), turn(2)]


def test_a_difference_found_later_turns_segments_off_for_later_prompts(
    chat: Loaded, caplog: pytest.LogCaptureFixture
) -> None:
    pre = preprocessor(chat.tokenizer)
    assert pre.segments is not None
    pre.segments = PromptSegments(pre.segments.tokens, user_turns_gain(chat.tokenizer))
    assert pre.off_path  # the default: prepared on a worker's input thread
    history = [Message(m["role"], m["content"]) for m in MESSAGES]
    expected = whole_ids(chat.tokenizer, MESSAGES)
    first = pre(chat_frame(CanonicalRequest(messages=history), "r-odd")).prompt
    assert first != expected and pre.segments.on  # on its way with its segments' ids
    with caplog.at_level(logging.WARNING, logger="worker.prompt_segments"):
        pre.run_checks()
    assert not pre.segments.on and "r-odd" in (pre.segments.off_reason or "")
    assert "this one ran on its segments' ids" in caplog.text
    assert pre(chat_frame(CanonicalRequest(messages=history), "r-next")).prompt == expected


def test_a_whole_encoding_that_fails_later_is_logged_and_leaves_segments_on(
    chat: Loaded, caplog: pytest.LogCaptureFixture
) -> None:
    """The request was served; without segments later prompts would meet the same failure."""
    segments = PromptSegments(CUTS, encoder(chat.tokenizer))

    def broken() -> list[int]:
        raise RuntimeError("template gone")

    segments.encode(turn(0), broken, "r1", check_later=True)
    with caplog.at_level(logging.ERROR, logger="worker.prompt_segments"):
        segments.run_checks()
    assert segments.on and "request r1: its prompt's whole encoding failed" in caplog.text
    assert "template gone" in caplog.text


def test_a_sharded_groups_preprocessor_checks_first(chat: Loaded) -> None:
    """off_path False (a group's ranks, which must decide alike): nothing is left for later."""
    pre = preprocessor(chat.tokenizer)
    assert pre.segments is not None
    pre.off_path = False
    wholes: list[str] = []
    pre.segments = PromptSegments(pre.segments.tokens, encoder(chat.tokenizer))
    history = [Message(m["role"], m["content"]) for m in MESSAGES]
    render = pre._render

    def counted_render(*args: object, **kwargs: object) -> object:
        wholes.append("whole")
        return render(*args, **kwargs)

    pre._render = counted_render  # type: ignore[method-assign]
    pre(chat_frame(CanonicalRequest(messages=history)))
    assert wholes == ["whole"]  # checked before it went on
    pre.run_checks()
    assert wholes == ["whole"]


def test_a_worker_of_its_own_prepares_off_path_and_a_sharded_groups_rank_does_not(
    chat: Loaded,
) -> None:
    loaded = LoadedModel(chat.model, chat.tokenizer, chat.path, 4096, is_demo=False)
    formats = model_formats(chat.tokenizer)
    assert text_preprocessor(loaded, EngineOptions(), formats).off_path
    assert not text_preprocessor(loaded, EngineOptions(), formats, group=object()).off_path
